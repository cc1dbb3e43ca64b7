import asyncio, httpx, sys, time, random
URL = "http://127.0.0.1:8123/v1/chat/completions"
SYSTEM = "You write travel articles. " * 120
async def one(c, i):
    body = {"model": "tiny", "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Article {i} {random.random()}: " + "about a city " * 40}],
            "max_tokens": 512, "ignore_eos": True}
    await c.post(URL, json=body)
done = []
async def main(seconds):
    end = time.monotonic() + seconds
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=200)) as c:
        i = 0
        async def worker():
            nonlocal i
            while time.monotonic() < end:
                i += 1
                await one(c, i)
                done.append(1)
        await asyncio.gather(*(worker() for _ in range(48)))
asyncio.run(main(float(sys.argv[1])))
print("requests done", len(done))
