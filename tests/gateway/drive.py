"""A request driver for the memory test, run as its own process so it does not share the GIL.

Usage: python -m tests.gateway.drive URL COUNT [CONCURRENCY]; prints the number of failures.
"""

from __future__ import annotations

import asyncio
import sys

import httpx

from server.gateway.proxy.transport import UpstreamTransport

BODIES = [
    {
        "model": "standin",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "stream_options": {"include_usage": True},
    },
    {"model": "standin", "messages": [{"role": "user", "content": "hi"}]},
    {"model": "standin", "prompt": "a b", "stream": True},
    {"model": "unknown", "messages": [{"role": "user", "content": "hi"}]},
]


async def drive(url: str, count: int, concurrency: int) -> int:
    """`count` requests, a mix of streamed, plain, completions and refused ones; returns failures."""
    failures = 0
    # The gateway's own transport: httpx's default pool costs more CPU than the gateway itself.
    transport = UpstreamTransport(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=30, transport=transport) as client:

        async def worker(offset: int) -> None:
            nonlocal failures
            for i in range(offset, count, concurrency):
                body = BODIES[i % len(BODIES)]
                path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
                response = await client.post(path, json=body)
                if response.status_code != (404 if body["model"] == "unknown" else 200):
                    failures += 1

        await asyncio.gather(*(worker(i) for i in range(concurrency)))
    return failures


if __name__ == "__main__":
    url, count = sys.argv[1], int(sys.argv[2])
    concurrency = int(sys.argv[3]) if len(sys.argv) > 3 else 32
    print(asyncio.run(drive(url, count, concurrency)))
