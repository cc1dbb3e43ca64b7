"""An interactive request beside a KV cache full of batch, on a real vLLM engine that schedules by
priority: vLLM preempts a batch request, and the interactive one is answered before any batch
answer ends.

The engine is tiny-cpu-priority with the tiny model's whole 4,096 positions and its KV cache cut
to 33 blocks of 128 tokens (`num-gpu-blocks-override`; vLLM keeps one back: 32, the least it
starts with). Four batch requests (16-token prompts), streamed through the gateway, each write
4,000 tokens: 32 blocks apiece at the end, 128 in all. Once the blocks their streams have
written fill the cache (each chunk carries the tokens so far: `continuous_usage_stats`), the
interactive request
goes in, one block's worth. vLLM never preempts for a waiting request, only when a running one
needs a block the cache lacks: the batch requests do, from their 9th block on, and the scheduler
preempts the lowest-priority running request (the newest batch one; again as the others grow).
The interactive request, first in vLLM's waiting queue by priority, takes the first block freed,
and is answered while the oldest batch request still has thousands of tokens to write (the
engine writes them far faster than a busy machine carries a request to it: hence the long
answers). First come first served (vLLM's default policy; here: every request at one priority)
puts each preempted batch request back at the head of the queue, and the interactive request
waits behind them.

What this shows: vLLM's `priority` comes from the tenant's class through the gate, the engine
preempted (a batch request, after it had written tokens, back in vLLM's waiting queue), and the
interactive answer came while every batch stream was still writing (then the test leaves them).
Nothing is timed: each step waits for what the streams report or the engine's queue shows (a
batch request waiting: preempted), bounded by a generous deadline. (The gate's own rule for a
full cache, counting only the lowest class in flight, is a unit test: the cache is full here for
tens of steps only.)
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from typing import Any

import httpx
import pytest
import yaml

from server.gateway.settings import GatewaySettings
from tests.engine_process import running_engine
from tests.gateway.flow.two_tenants import KEYS, PROFILE, metric_sum, two_tenants

pytestmark = [pytest.mark.engine, pytest.mark.one_process("one engine, one gateway worker: the order is the engine's")]

BLOCKS, BLOCK = 33, 128  # the cut cache: one longest request (vLLM starts only so), and one block
USABLE = BLOCKS - 1  # vLLM keeps one block back (its null block)
MAX_MODEL_LEN = 4096  # the tiny model's positions: the longest batch answers, the longest wait
BATCH, BATCH_PROMPT, BATCH_TOKENS = 4, 16, 4000  # 4 x 32 blocks at the end, against USABLE
INTERACTIVE_PROMPT = 100  # tokens: with its 4 output tokens, one block
DEADLINE = 900.0  # seconds for the whole scenario on a busy machine


@pytest.fixture(scope="module")
def small_cache_engine(tmp_path_factory: pytest.TempPathFactory) -> Any:
    directory = tmp_path_factory.mktemp("preemption")
    profile = yaml.safe_load(PROFILE.read_text())
    profile["model"] = str((PROFILE.parent / profile["model"]).resolve())
    profile["vllm"]["num-gpu-blocks-override"] = BLOCKS
    profile["vllm"]["max-model-len"] = MAX_MODEL_LEN
    profile["description"] = f"tiny-cpu-priority with a KV cache of {BLOCKS} blocks (preemption test)"
    derived = directory / "tiny-cpu-priority-small-cache.yaml"
    derived.write_text(yaml.safe_dump(profile))
    yield from running_engine(derived, directory, reuse_env="TEST_SMALL_CACHE_ENGINE_URL")


def settings(url: str) -> GatewaySettings:
    return two_tenants(url, timeouts={"first_byte": DEADLINE, "idle": DEADLINE, "total": DEADLINE})


async def engine_queues(client: httpx.AsyncClient, engine_url: str) -> None:
    """Returns once the engine has a request waiting: a batch request preempted, the cache full.
    The streams alone can say so late: vLLM may preempt three batch requests early and run one
    to its end, and the blocks the streams have written then reach the cache's size only as that
    answer ends (seen once in a clean-clone run: the batch answer ended first)."""
    while True:
        try:
            text = (await client.get(f"{engine_url}/metrics", timeout=60)).text
        except httpx.TransportError:  # (a kept-alive connection the engine closed: ask again)
            text = ""
        if metric_sum(text, "vllm:num_requests_waiting") >= 1:
            return
        await asyncio.sleep(0.05)


def blocks(tokens: int) -> int:
    return -(-tokens // BLOCK)


class Stream:
    """One streamed completion: the tokens it has written so far, and when it ended."""

    def __init__(self) -> None:
        self.written = 0
        self.done: float | None = None
        self.status: int | None = None
        self.tokens: int | None = None  # completion_tokens of its usage
        self.last: deque[bytes] = deque(maxlen=3)  # its last lines, for a failure's message

    def __repr__(self) -> str:
        return f"Stream(status={self.status}, written={self.written}, tokens={self.tokens}, last={list(self.last)})"


async def complete(
    client: httpx.AsyncClient, url: str, tenant: str, prompt: list[int], tokens: int, out: Stream
) -> None:
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": tokens,
        "ignore_eos": True,
        "stream": True,
        # every chunk carries the tokens written so far (vLLM merges chunks for a slow reader)
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    headers = {"authorization": f"Bearer {KEYS[tenant]}"}
    async with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as response:
        out.status = response.status_code
        if response.status_code != 200:
            await response.aread()
            out.done = time.monotonic()
            return
        pending = b""
        async for data in response.aiter_bytes():
            *lines, pending = (pending + data).split(b"\n")  # not aiter_lines: random text holds U+2028
            for line in lines:
                if line.strip():
                    out.last.append(line[:300])
                if not line.startswith(b"data: {"):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    out.written = out.tokens = chunk["usage"]["completion_tokens"]
    out.done = time.monotonic()


def test_an_interactive_request_beside_a_full_cache_of_batch_is_answered_before_any_batch_ends(
    small_cache_engine, gateway
):
    gw = gateway(settings(small_cache_engine.url))

    async def scenario() -> tuple[list[Stream], Stream, list[bool], bool]:
        async with httpx.AsyncClient(timeout=DEADLINE) as client:
            batch = [Stream() for _ in range(BATCH)]
            tasks = [
                asyncio.create_task(complete(client, gw.url, "articles", [100 + i] * BATCH_PROMPT, BATCH_TOKENS, s))
                for i, s in enumerate(batch)
            ]
            deadline = time.monotonic() + DEADLINE
            watch = asyncio.create_task(engine_queues(client, small_cache_engine.url))
            try:
                while sum(blocks(BATCH_PROMPT + s.written) for s in batch) < USABLE and not watch.done():
                    assert not any(t.done() for t in tasks), ("a batch answer ended first", batch)
                    assert time.monotonic() < deadline, batch
                    await asyncio.sleep(0.01)
                if watch.done():
                    watch.result()  # (an error in the watch is the test's, never a full cache)
            finally:
                watch.cancel()
            interactive = Stream()
            prompt = [(7 * i) % 500 + 10 for i in range(INTERACTIVE_PROMPT)]  # in the tiny vocabulary (554)
            await complete(client, gw.url, "planner", prompt, 4, interactive)
            # Answered while every batch stream was still writing: it did not wait for a batch
            # answer. Then the batch streams are left (the gateway aborts them at the engine):
            # their thousands of tokens still to write, preempted and recomputed, would take a
            # busy machine a minute more and show nothing more.
            writing = [s.done is None and s.written > 0 for s in batch]
            # The engine preempted: with every batch request started (each has written tokens), one
            # is back in its queue. (vLLM counts a preemption in its metrics only once that request
            # runs again: after a batch answer ends, the tail this test leaves.)
            queued = asyncio.create_task(engine_queues(client, small_cache_engine.url))
            ended = asyncio.gather(*tasks)
            await asyncio.wait([queued, ended], timeout=DEADLINE, return_when=asyncio.FIRST_COMPLETED)
            preempted = queued.done() and queued.exception() is None
            for task in (queued, ended, *tasks):
                task.cancel()
            await asyncio.gather(queued, ended, return_exceptions=True)
            return batch, interactive, writing, preempted

    batch, interactive, writing, preempted = asyncio.run(scenario())
    assert interactive.status == 200 and interactive.tokens == 4, interactive
    assert all(s.status == 200 for s in batch), batch
    assert all(writing), ("a batch answer ended before the interactive one", batch)
    assert preempted, ("no batch request went back to the engine's queue", batch)
