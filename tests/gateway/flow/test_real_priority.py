"""The flow gate in front of a real vLLM engine that schedules by priority (tiny-cpu-priority):
vLLM accepts the `priority` the gateway sets from the class (it rejects a non-zero one without
the flag), and runs an interactive request before batch requests that were waiting in its queue.

vLLM 0.32 preempts a running request only when its KV cache is short (never for a full batch of
sequences: docs/operate/flow-control.md), which the tiny model's 1 GiB cache never is here: what
is shown is vLLM's queue order, which is what lets the gate send a higher class in beside a full
lower one. Set TEST_PRIORITY_ENGINE_URL to reuse a running engine of that profile."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest

from server.gateway.settings import GatewaySettings
from tests.engine_process import running_engine
from tests.gateway.flow.two_tenants import KEYS, PROFILE, two_tenants

pytestmark = [pytest.mark.engine, pytest.mark.one_process("one engine, one gateway worker: the order is the engine's")]

RUNNING = 32  # the engine's max-num-seqs: these fill it
WAITING = 8  # batch requests sent once it is full: they wait in vLLM's queue
# The running requests are sent one at a time, each once the one before runs, and the i-th answers
# BATCH_TOKENS + STAGGER * i tokens: each starts later and runs longer than the one before, so the
# engine frees its slots one at a time, over STAGGER steps apart, and each freed slot goes to the
# head of its queue. Answers of one length, sent at once, end in one engine step: every slot frees
# together, the interactive request and all the waiting batch start in one step, and which first
# token comes first is the relay's toss (the clean-clone make test of 4b1f53a lost it).
# BATCH_TOKENS is long enough on a busy machine for a slow /metrics poll to see the queue and for the
# interactive request to arrive while it lasts. The waiting answers and the interactive one are long
# enough that the slots they free come steps after the interactive request's first token: with
# 16-token waiting answers under two CPU hogs, three came within 1 ms of it.
BATCH_TOKENS = 1000
STAGGER = 16
WAITING_TOKENS = 100
INTERACTIVE_TOKENS = 16


@pytest.fixture(scope="module")
def priority_engine(tmp_path_factory: pytest.TempPathFactory) -> Any:
    yield from running_engine(PROFILE, tmp_path_factory.mktemp("priority"), reuse_env="TEST_PRIORITY_ENGINE_URL")


def settings(url: str) -> GatewaySettings:
    return two_tenants(
        url,
        # The gate lets everything through (64 > the engine's 32): vLLM's own queue decides.
        flow={"max_num_seqs": 64, "batch_headroom": 0},
        timeouts={"first_byte": 600.0, "idle": 300.0, "total": 900.0},
    )


async def first_token_at(client: httpx.AsyncClient, url: str, tenant: str, tokens: int) -> float:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": f"{tenant}: write about Lisbon."}],
        "max_tokens": tokens,
        "ignore_eos": True,
        "stream": True,
    }
    headers = {"authorization": f"Bearer {KEYS[tenant]}"}
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers) as response:
        assert response.status_code == 200, await response.aread()
        first = None
        async for line in response.aiter_lines():
            compact = line.replace(" ", "")
            if (
                first is None
                and compact.startswith("data:{")
                and '"content":"' in compact
                and '"content":""' not in compact
            ):
                first = time.perf_counter()
        assert first is not None
        return first


def test_the_class_reaches_vllm_as_priority_and_vllm_runs_interactive_before_waiting_batch(priority_engine, gateway):
    gw = gateway(settings(priority_engine.url))

    def engine_gauge(name: str) -> float:
        text = httpx.get(f"{priority_engine.url}/metrics", timeout=10).text
        for line in text.splitlines():
            if line.startswith(f"vllm:{name}{{"):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    async def until(name: str, count: int) -> None:
        deadline = time.monotonic() + 300
        while await asyncio.to_thread(engine_gauge, name) < count:
            assert time.monotonic() < deadline, f"the engine's {name} never reached {count}"
            await asyncio.sleep(0.1)

    async def scenario() -> tuple[list[float], float]:
        async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=100)) as client:

            def articles(tokens: int) -> asyncio.Task[float]:
                return asyncio.create_task(first_token_at(client, gw.url, "articles", tokens))

            running = []
            for i in range(RUNNING):
                running.append(articles(BATCH_TOKENS + STAGGER * i))
                await until("num_requests_running", i + 1)
            waiting = [articles(WAITING_TOKENS) for _ in range(WAITING)]
            await until("num_requests_waiting", WAITING)
            interactive = await first_token_at(client, gw.url, "planner", INTERACTIVE_TOKENS)
            await asyncio.gather(*running)
            return list(await asyncio.gather(*waiting)), interactive

    waiting, interactive = asyncio.run(scenario())
    passed = sum(1 for t in waiting if t > interactive)
    # First come first served, the interactive request (sent last) would start after every waiting one.
    assert passed >= WAITING // 2, (passed, sorted(waiting), interactive)


def test_a_non_zero_priority_is_accepted_only_because_the_profile_schedules_by_priority(priority_engine):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "priority": 2}
    answer = httpx.post(f"{priority_engine.url}/v1/chat/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
