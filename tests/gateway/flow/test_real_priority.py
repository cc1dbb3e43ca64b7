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
from tests.gateway.flow.two_tenants import KEYS, PROFILE, metric_sum, two_tenants

pytestmark = [pytest.mark.engine, pytest.mark.one_process("one engine, one gateway worker: the order is the engine's")]

RUNNING = 32  # the engine's max-num-seqs: these fill it
WAITING = 8  # batch requests sent once it is full: they wait in vLLM's queue
# The test frees one slot itself, by leaving one running stream (the gateway aborts its engine
# request), once the waiting batch and then the interactive request are in vLLM's queue; the
# request at the head of the queue takes it. No answer ends on its own while the test looks:
# answers of one length sent together end in one engine step, and freed every slot at once in
# the test before (the interactive request and all eight waiting ones started in one step, and
# the clean-clone make test of 4b1f53a lost the relay's toss); staggered lengths with the running
# requests sent one by one let the first ones end before the last started on a fresh engine
# (the clean-clone make test of e87a40e).
BATCH_TOKENS = 1900  # (max-model-len 2048) thousands of engine steps with 32 running
INTERACTIVE_TOKENS = 200  # it holds the slot it took while the test looks


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


async def stream(client: httpx.AsyncClient, url: str, tenant: str, tokens: int, first: asyncio.Event) -> None:
    """One streamed chat request of `tenant` through the gateway; `first` is set at its first
    content token. Runs until the answer ends or the task is cancelled (the client leaves)."""
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
        async for line in response.aiter_lines():
            compact = line.replace(" ", "")
            if (
                not first.is_set()
                and compact.startswith("data:{")
                and '"content":"' in compact
                and '"content":""' not in compact
            ):
                first.set()


def test_the_class_reaches_vllm_as_priority_and_vllm_runs_interactive_before_waiting_batch(priority_engine, gateway):
    gw = gateway(settings(priority_engine.url))

    def engine_gauge(name: str) -> float:
        return metric_sum(httpx.get(f"{priority_engine.url}/metrics", timeout=10).text, f"vllm:{name}")

    async def until(name: str, count: int, tasks: list[asyncio.Task[None]]) -> None:
        deadline = time.monotonic() + 300
        while await asyncio.to_thread(engine_gauge, name) < count:
            for task in tasks:
                if task.done():
                    task.result()  # (a request that failed: its error, not the deadline's)
                    raise AssertionError(f"a request ended while the engine's {name} was below {count}")
            assert time.monotonic() < deadline, f"the engine's {name} never reached {count}"
            await asyncio.sleep(0.1)

    async def scenario() -> tuple[bool, list[bool]]:
        async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=100)) as client:
            tasks: list[asyncio.Task[None]] = []
            watching: list[asyncio.Task[bool]] = []

            def send(tenant: str, tokens: int) -> asyncio.Event:
                first = asyncio.Event()
                tasks.append(asyncio.create_task(stream(client, gw.url, tenant, tokens, first)))
                return first

            try:
                for _ in range(RUNNING):
                    send("articles", BATCH_TOKENS)
                await until("num_requests_running", RUNNING, tasks)
                waiting = [send("articles", BATCH_TOKENS) for _ in range(WAITING)]
                await until("num_requests_waiting", WAITING, tasks)
                interactive = send("planner", INTERACTIVE_TOKENS)
                await until("num_requests_waiting", WAITING + 1, tasks)
                tasks[0].cancel()  # a running stream leaves: its slot is the only one that frees
                watching = [asyncio.create_task(first.wait()) for first in [interactive, *waiting]]
                started, _ = await asyncio.wait(watching, timeout=300, return_when=asyncio.FIRST_COMPLETED)
                assert started, "nothing waiting started once a slot was free"
                return interactive.is_set(), [first.is_set() for first in waiting]
            finally:
                for task in [*tasks, *watching]:
                    task.cancel()
                await asyncio.gather(*tasks, *watching, return_exceptions=True)

    interactive_started, batch_started = asyncio.run(scenario())
    # First come first served, the slot would go to the first waiting batch request (sent earlier).
    assert interactive_started and not any(batch_started), (interactive_started, batch_started)


def test_a_non_zero_priority_is_accepted_only_because_the_profile_schedules_by_priority(priority_engine):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "priority": 2}
    answer = httpx.post(f"{priority_engine.url}/v1/chat/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
