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

WAITING = 8  # batch requests beyond the engine's max-num-seqs (32): they wait in vLLM's queue
# Each batch answer's length: the waiting ones wait that many engine steps, long enough on a busy
# machine for a slow /metrics poll to see them and for the interactive request to arrive. The
# engine writes hundreds of tokens a second while two CPU hogs make the request path take seconds:
# at 96 tokens the poll missed the queue, at 400 the interactive request came after it.
BATCH_TOKENS = 1500


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

    async def scenario() -> tuple[list[float], float]:
        async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=100)) as client:
            batch = [
                asyncio.create_task(first_token_at(client, gw.url, "articles", BATCH_TOKENS))
                for _ in range(32 + WAITING)
            ]

            def engine_queue() -> float:
                text = httpx.get(f"{priority_engine.url}/metrics", timeout=10).text
                for line in text.splitlines():
                    if line.startswith("vllm:num_requests_waiting{"):
                        return float(line.rsplit(" ", 1)[1])
                return 0.0

            deadline = time.monotonic() + 300
            while await asyncio.to_thread(engine_queue) < WAITING // 2:  # batch waits in vLLM's queue
                assert time.monotonic() < deadline, "the engine never queued the batch"
                await asyncio.sleep(0.1)
            interactive = await first_token_at(client, gw.url, "planner", 4)
            return list(await asyncio.gather(*batch)), interactive

    batch, interactive = asyncio.run(scenario())
    passed = sum(1 for t in batch if t > interactive)
    # First come first served, the interactive request (sent last) would start after every batch one.
    assert passed >= WAITING // 2, (passed, sorted(batch)[-WAITING:], interactive)


def test_a_non_zero_priority_is_accepted_only_because_the_profile_schedules_by_priority(priority_engine):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "priority": 2}
    answer = httpx.post(f"{priority_engine.url}/v1/chat/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
