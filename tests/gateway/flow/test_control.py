"""The gate's rules without I/O: FlowControl on real Engine and ModelPool objects, its clock and
its engines' figures set by the test. Every rule of server.gateway.flow.control has a test here."""

from __future__ import annotations

import asyncio

import pytest

from server.gateway.flow.classes import Class, request_class
from server.gateway.flow.control import FlowControl, Pass
from server.gateway.flow.errors import QueueRefused
from server.gateway.flow.fairshare import VirtualCounters
from server.gateway.flow.saturation import capacity
from server.gateway.replicas.engine import Engine, EngineMetrics
from server.gateway.replicas.pool import ModelPool
from server.gateway.settings import Flow


def pool(n: int = 1) -> ModelPool:
    return ModelPool("m", [Engine("m", f"http://127.0.0.1:{9000 + i}") for i in range(n)])


def control(**settings: object) -> FlowControl:
    return FlowControl(Flow.model_validate({"max_num_seqs": 2, "tick_s": 0.01, "batch_headroom": 0, **settings}))


def usage(prompt: int, completion: int, cached: int = 0) -> dict[str, object]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def take_turn(
    gate: FlowControl, p: ModelPool, tenant: str, cost: float, answer: dict[str, object], served: list[str]
) -> None:
    """One batch request of `tenant`: waits its turn, notes it in `served`, ends with `answer`'s usage."""
    mine = await gate.enter(p, tenant, "batch", cost)
    served.append(tenant)
    await asyncio.sleep(0)
    gate.leave(mine, answer)


def test_a_client_may_lower_its_class_never_raise_it() -> None:
    assert request_class("interactive", None) == "interactive"
    assert request_class("interactive", "batch") == "batch"
    assert request_class("standard", " Batch ") == "batch"
    assert request_class("batch", "interactive") == "batch"
    assert request_class("standard", "interactive") == "standard"
    assert request_class("standard", "urgent") == "standard"


def sent(gate: FlowControl, p: ModelPool, tenant: str, klass: Class, reserve: float) -> Pass | None:
    """`pass_now`, then `book` as the gateway does once the engine has the request."""
    held = gate.pass_now(p, tenant, klass, reserve)
    if held is not None:
        gate.book(held)
    return held


def test_a_request_let_in_at_once_is_charged_when_booked_once_and_by_its_settlement_if_never_booked() -> None:
    gate, p = control(), pool()
    answered(gate, p, "t", usage(40, 10))  # the tenant's prompts now cost 40 lately
    before = gate.counters.get("t")
    held = gate.pass_now(p, "t", "standard", 5)
    assert held is not None and not held.booked
    assert gate.counters.get("t") == before and gate.models["m"].inflight == 1  # its room taken, not yet charged
    gate.book(held)
    gate.book(held)  # (once)
    assert gate.counters.get("t") == before + 45 and held.charged == 45
    assert gate.tally.admitted_total["m", "standard", "t", "false"] == 2
    gate.leave(held, usage(40, 10))  # used 50 of 45
    assert gate.counters.get("t") == before + 50 and gate.models["m"].inflight == 0
    never = gate.pass_now(p, "t", "standard", 5)
    assert never is not None
    gate.leave(never, usage(40, 10))  # never booked (the engine was not reached): booked, then settled
    assert never.booked and gate.counters.get("t") == before + 100
    assert gate.tally.admitted_total["m", "standard", "t", "false"] == 3


def answered(gate: FlowControl, p: ModelPool, tenant: str, answer: dict[str, object]) -> None:
    """One request of `tenant` let in at once and answered with this `usage`."""
    held = gate.pass_now(p, tenant, "standard", 5)
    assert held is not None
    gate.leave(held, answer)


def test_an_answer_is_charged_the_uncached_part_of_its_prompt_and_its_output() -> None:
    gate, p = control(), pool()
    for prompt, cached, uncached in ((1000, 900, 100), (10, 50, 0), (10, 0, 10)):  # (10, 50): never below 0
        before, served = gate.counters.get("t"), gate.tally.served_tokens["m", "t"]
        answered(gate, p, "t", usage(prompt, 7, cached=cached))
        assert gate.counters.get("t") == before + uncached + 7  # the reservation given back
        assert gate.tally.served_tokens["m", "t"] == served + uncached + 7


def test_a_tenant_back_from_a_pause_is_lifted_to_the_waiting_minimum() -> None:
    counters = VirtualCounters()
    counters.charge("busy", 500)
    counters.charge("other", 800)
    counters.lift("idle", ["busy", "other"])
    assert counters.get("idle") == 500
    counters.charge("rich", 2000)
    counters.lift("rich", ["busy"])
    assert counters.get("rich") == 2000  # never lowered


def test_capacity_counts_healthy_engines_not_full_and_a_workers_share() -> None:
    engines = pool(3).engines
    assert capacity(engines, 32, 0.98) == 96
    engines[0].healthy = False
    engines[1].record_scrape(EngineMetrics(kv_usage=0.99), at=0.0)
    assert capacity(engines, 32, 0.98) == 32
    assert capacity(engines, 32, 0.98, workers=3) == 11
    assert capacity(engines, 1, 0.98, workers=4) == 1


async def test_requests_pass_at_once_while_there_is_room_and_wait_when_full() -> None:
    gate, p = control(), pool()
    first = await gate.enter(p, "a", "standard", 10)
    second = await gate.enter(p, "a", "standard", 10)
    assert first.waited == second.waited == 0
    third = asyncio.create_task(gate.enter(p, "a", "standard", 10))
    await settle()
    assert not third.done() and gate.models["m"].total == 1
    gate.leave(first, usage(5, 5))
    held = await asyncio.wait_for(third, 30)  # admitted in the same step as the leave
    assert gate.models["m"].inflight == 2 and held.waited > 0
    gate.leave(second, None)
    gate.leave(held, None)
    gate.leave(held, None)  # twice is once
    assert gate.models["m"].inflight == 0


async def test_higher_classes_go_first_and_a_newcomer_never_passes_a_waiting_request() -> None:
    gate, p = control(), pool()
    running = [await gate.enter(p, "t", "batch", 1) for _ in range(2)]
    order: list[str] = []

    async def one(tenant: str, klass: str) -> Pass:
        held = await gate.enter(p, tenant, klass, 1)  # type: ignore[arg-type]
        order.append(klass)
        return held

    tasks = [asyncio.create_task(one("b", "batch")), asyncio.create_task(one("s", "standard"))]
    await settle()
    tasks.append(asyncio.create_task(one("i", "interactive")))
    await settle()
    for held in running:
        gate.leave(held, None)
    admitted = [await asyncio.wait_for(tasks[2], 30), await asyncio.wait_for(tasks[1], 30)]
    assert order == ["interactive", "standard"]
    gate.leave(admitted[0], None)
    await asyncio.wait_for(tasks[0], 30)
    assert order == ["interactive", "standard", "batch"]


async def test_within_a_class_the_smallest_virtual_counter_goes_first() -> None:
    """Tenant heavy sends ten times as many requests: while both wait, they alternate by tokens served."""
    gate, p = control(max_num_seqs=1), pool()
    held = await gate.enter(p, "heavy", "batch", 100)
    served: list[str] = []
    tasks = [asyncio.create_task(take_turn(gate, p, "heavy", 100, usage(100, 100), served)) for _ in range(20)]
    await settle()
    tasks += [asyncio.create_task(take_turn(gate, p, "light", 100, usage(100, 100), served)) for _ in range(2)]
    await settle()
    gate.leave(held, usage(100, 100))
    await asyncio.wait_for(asyncio.gather(*tasks), 30)
    # light arrived after 20 of heavy's, and still went second and fourth (lifted, not banked).
    assert served.index("light") <= 2 and served[:5].count("light") == 2, served


async def test_requests_let_in_at_once_count_before_they_end_so_a_newcomer_gets_half_not_all() -> None:
    """Heavy's first batch went straight in (room); its reservations are on its counter at once, so
    light, lifted to it when it starts waiting, alternates with heavy instead of being served alone
    until heavy's first batch has ended and settled (light took every slot before this rule)."""
    gate, p = control(max_num_seqs=4), pool()
    first = [sent(gate, p, "heavy", "batch", 100) for _ in range(4)]
    assert all(held is not None for held in first) and gate.counters.get("heavy") == 400
    assert gate.pass_now(p, "heavy", "batch", 100) is None  # full: it must wait
    served: list[str] = []
    tasks = [asyncio.create_task(take_turn(gate, p, "heavy", 100, usage(50, 50), served)) for _ in range(20)]
    await settle()
    tasks += [asyncio.create_task(take_turn(gate, p, "light", 100, usage(50, 50), served)) for _ in range(4)]
    await settle()
    assert gate.counters.get("light") == 400  # lifted to heavy's, reservations included
    for held in first:
        assert held is not None
        gate.leave(held, usage(50, 50))  # used what it reserved: nothing returned
    await asyncio.wait_for(asyncio.gather(*tasks), 30)
    assert served[:4].count("light") == 2 and served[:8].count("light") == 4, served


def test_a_tenants_recent_prompt_cost_is_a_moving_average_and_a_newcomer_gets_the_models() -> None:
    gate, p = control(), pool()
    costs = gate.prompt_costs
    assert costs.expect("m", "a") == 0  # nothing settled on the model yet
    answered(gate, p, "a", usage(100, 1))
    answered(gate, p, "a", usage(30, 1, cached=30))  # all cached: cost 0; the newest answer weighs 0.2
    assert costs.expect("m", "a") == pytest.approx(80)
    answered(gate, p, "b", usage(10, 1))
    assert costs.expect("m", "b") == 10
    assert costs.expect("m", "new") == pytest.approx(0.8 * 80 + 0.2 * 10)  # the model's average
    assert costs.expect("other", "a") == 0  # per model


async def test_a_request_let_in_at_once_reserves_its_tenants_recent_prompt_cost_too() -> None:
    """Its prompt is unread, so it reserves what its tenant's prompts cost lately (a new tenant:
    the model's average). Heavy's batch in flight then weighs on its counter with its prompts, and
    light, lifted to it, alternates with heavy: without the prompts, heavy's settlements would
    have added them after the lift, and light would have gone first until it caught up."""
    gate, p = control(max_num_seqs=4), pool()
    earlier = sent(gate, p, "heavy", "batch", 50)
    assert earlier is not None and gate.counters.get("heavy") == 50  # nothing settled yet: no prompt cost
    gate.leave(earlier, usage(80, 50, cached=30))  # its prompt cost 50
    assert gate.prompt_costs.expect("m", "heavy") == 50 and gate.prompt_costs.expect("m", "new") == 50
    before = gate.counters.get("heavy")
    first = [sent(gate, p, "heavy", "batch", 50) for _ in range(4)]
    assert all(held is not None for held in first) and gate.counters.get("heavy") == before + 4 * 100
    served: list[str] = []
    tasks = [asyncio.create_task(take_turn(gate, p, "heavy", 100, usage(80, 50, cached=30), served)) for _ in range(20)]
    await settle()
    tasks += [asyncio.create_task(take_turn(gate, p, "light", 100, usage(80, 50, cached=30), served)) for _ in range(4)]
    await settle()
    assert gate.counters.get("light") == gate.counters.get("heavy")
    for held in first:
        assert held is not None
        gate.leave(held, usage(80, 50, cached=30))  # cost what it reserved: the counter stands
    await asyncio.wait_for(asyncio.gather(*tasks), 30)
    assert served[:4].count("light") == 2 and served[:8].count("light") == 4, served


async def test_uncached_charging_serves_a_cached_prefix_tenant_more() -> None:
    gate, p = control(max_num_seqs=1), pool()
    held = await gate.enter(p, "x", "batch", 0)
    served: list[str] = []

    async def one(tenant: str, cached: int) -> None:
        mine = await gate.enter(p, tenant, "batch", 0)
        served.append(tenant)
        await asyncio.sleep(0)
        gate.leave(mine, usage(1000, 10, cached=cached))

    tasks = [asyncio.create_task(one("shared", 900)) for _ in range(30)]
    tasks += [asyncio.create_task(one("unique", 0)) for _ in range(30)]
    await settle()
    gate.leave(held, None)
    await asyncio.wait_for(asyncio.gather(*tasks), 30)
    first = served[:30]  # both backlogged: 110 tokens a request against 1,010, so ~9 to 1
    assert first.count("shared") >= 5 * first.count("unique") > 0, first
    assert gate.counters.get("shared") == 30 * 110 and gate.counters.get("unique") == 30 * 1010


async def test_a_full_class_queue_is_refused_429_with_retry_after() -> None:
    gate, p = control(max_queued={"batch": 1}), pool()
    [await gate.enter(p, "t", "batch", 1) for _ in range(2)]
    waiting = asyncio.create_task(gate.enter(p, "t", "batch", 1))
    await settle()
    with pytest.raises(QueueRefused) as refused:
        await gate.enter(p, "t", "batch", 1)
    assert refused.value.status == 429 and refused.value.code == "queue_full"
    assert refused.value.headers == [(b"retry-after", str(refused.value.retry_after).encode())]
    assert gate.tally.shed_total["m", "batch", "t", "queue_full"] == 1
    waiting.cancel()


async def test_a_request_past_its_class_wait_is_refused() -> None:
    gate, p = control(max_wait={"interactive": 0.05}), pool()
    [await gate.enter(p, "t", "batch", 1) for _ in range(2)]
    with pytest.raises(QueueRefused) as refused:
        await gate.enter(p, "t", "interactive", 1)
    assert refused.value.code == "queue_timeout"
    assert gate.models["m"].total == 0 and gate.models["m"].inflight == 2


async def test_the_wait_is_capped_below_the_first_byte_deadline() -> None:
    gate = FlowControl(Flow(max_num_seqs=1, batch_headroom=0), wait_cap=0.05)
    p = pool()
    await gate.enter(p, "t", "batch", 1)
    with pytest.raises(QueueRefused):
        await gate.enter(p, "t", "batch", 1)  # 110 s by default; 0.0475 s under a 0.05 s deadline


async def test_when_every_queue_is_full_batch_is_shed_first_interactive_last() -> None:
    gate, p = control(max_queued_total=2), pool()
    [await gate.enter(p, "t", "standard", 1) for _ in range(2)]
    old = asyncio.create_task(gate.enter(p, "b", "batch", 1))
    await settle()
    new = asyncio.create_task(gate.enter(p, "b", "batch", 1))
    await settle()
    interactive = asyncio.create_task(gate.enter(p, "i", "interactive", 1))
    await settle()
    with pytest.raises(QueueRefused) as displaced:
        await asyncio.wait_for(new, 30)  # the newest batch request gave its place
    assert displaced.value.code == "queue_displaced"
    assert not old.done() and not interactive.done()
    with pytest.raises(QueueRefused):
        await gate.enter(p, "b", "batch", 1)  # a batch newcomer displaces nobody
    old.cancel()
    interactive.cancel()


async def test_a_request_cancelled_while_queued_leaves_the_queue_and_takes_no_slot() -> None:
    gate, p = control(), pool()
    running = [await gate.enter(p, "t", "batch", 1) for _ in range(2)]
    gone = asyncio.create_task(gate.enter(p, "t", "batch", 1))
    await settle()
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert gate.models["m"].total == 0
    assert gate.tally.shed_total["m", "batch", "t", "client_left"] == 1
    gate.leave(running[0], None)
    assert gate.models["m"].inflight == 1


async def test_no_healthy_engine_lets_requests_through_for_routing_to_answer_503() -> None:
    gate, p = control(), pool()
    [await gate.enter(p, "t", "batch", 1) for _ in range(2)]
    waiting = asyncio.create_task(gate.enter(p, "t", "batch", 1))
    await settle()
    p.engines[0].healthy = False
    await asyncio.wait_for(waiting, 30)  # the tick sees the model has no engine: routing will say 503
    assert (await gate.enter(p, "t", "batch", 1)).waited == 0


async def test_capacity_that_grows_without_a_departure_admits_on_the_tick() -> None:
    gate, p = control(), pool(2)
    p.engines[1].healthy = False
    [await gate.enter(p, "t", "batch", 1) for _ in range(2)]
    waiting = asyncio.create_task(gate.enter(p, "t", "batch", 1))
    await settle()
    assert not waiting.done()
    p.engines[1].healthy = True  # back up (a health check): work-conserving, no leave needed
    await asyncio.wait_for(waiting, 30)


async def test_settling_returns_an_unused_reservation() -> None:
    gate, p = control(), pool()
    held = await gate.enter(p, "t", "batch", 300)
    assert gate.counters.get("t") == 300
    gate.leave(held, usage(200, 40, cached=150))
    assert gate.counters.get("t") == 90
    assert gate.tally.served_tokens["m", "t"] == 90


async def test_with_priority_scheduling_a_higher_class_goes_in_beside_a_full_lower_one() -> None:
    """vLLM's priority policy runs it first (preempting batch): it need not wait for a batch slot."""
    gate = FlowControl(Flow(max_num_seqs=2, tick_s=0.01, batch_headroom=0), priority_models=frozenset({"m"}))
    p = pool()
    batch = [await gate.enter(p, "b", "batch", 1) for _ in range(2)]
    queued_batch = asyncio.create_task(gate.enter(p, "b", "batch", 1))
    await settle()
    assert not queued_batch.done()
    interactive = [await asyncio.wait_for(gate.enter(p, "i", "interactive", 1), 30) for _ in range(2)]
    assert all(held.waited < 30 for held in interactive)
    third = asyncio.create_task(gate.enter(p, "i", "interactive", 1))  # its own class is full: it waits
    await settle()
    assert not third.done()
    gate.leave(batch[0], None)
    await settle()
    assert not third.done() and not queued_batch.done()  # batch leaving frees no interactive room
    gate.leave(interactive[0], None)
    await asyncio.wait_for(third, 30)
    assert not queued_batch.done()
    queued_batch.cancel()


async def test_with_priority_scheduling_a_full_kv_cache_holds_only_the_lowest_class_in_flight() -> None:
    """vLLM's priority policy preempts the lowest class running for KV space: an interactive
    request goes in beside batch requests that fill the cache; with no lower class in flight to
    make way, or on an engine without the policy, a full cache holds it at the gateway."""
    settings = Flow(max_num_seqs=8, tick_s=0.01, batch_headroom=0)
    gate, p = FlowControl(settings, priority_models=frozenset({"m"})), pool()
    batch = await gate.enter(p, "b", "batch", 1)
    p.engines[0].record_scrape(EngineMetrics(kv_usage=0.99), at=0.0)  # the batch filled the cache
    assert gate.pass_now(p, "b", "batch", 1) is None  # the cache is full for batch
    interactive = gate.pass_now(p, "i", "interactive", 1)
    assert interactive is not None  # batch in flight: vLLM preempts it for the interactive one
    standard = gate.pass_now(p, "s", "standard", 1)
    assert standard is not None  # batch is below standard too
    gate.leave(batch, None)
    gate.leave(standard, None)
    assert gate.pass_now(p, "i", "interactive", 1) is None  # nothing lower in flight to preempt
    gate.leave(interactive, None)

    plain, fcfs = FlowControl(settings), pool()  # FCFS engines: vLLM would preempt the newest, the interactive one
    held = await plain.enter(fcfs, "b", "batch", 1)
    fcfs.engines[0].record_scrape(EngineMetrics(kv_usage=0.99), at=0.0)
    assert plain.pass_now(fcfs, "i", "interactive", 1) is None
    plain.leave(held, None)


async def test_batch_leaves_headroom_for_the_classes_above() -> None:
    """vLLM preempts for KV space only: a batch that fills max-num-seqs would keep the next
    interactive turn waiting for a batch answer to end, so batch stops short of the last slots."""
    gate = FlowControl(Flow(max_num_seqs=32, batch_headroom=0.0625, tick_s=0.01))
    p = pool()
    assert gate.headroom(32) == 2 and gate.headroom(2) == 1 and gate.headroom(1) == 0
    batch = [await gate.enter(p, "b", "batch", 1) for _ in range(30)]
    waiting = asyncio.create_task(gate.enter(p, "b", "batch", 1))
    await settle()
    assert not waiting.done()  # 30 of 32: batch's share is full
    turns = [await asyncio.wait_for(gate.enter(p, "i", "interactive", 1), 30) for _ in range(2)]  # nobody left
    assert gate.models["m"].inflight == 32
    gate.leave(turns[0], None)
    await settle()
    assert not waiting.done()  # an interactive slot freed is not batch's
    gate.leave(batch[0], None)
    await settle()
    assert not waiting.done()  # 29 batch + 1 interactive: free slots must stay >= the headroom
    gate.leave(turns[1], None)
    await asyncio.wait_for(waiting, 30)


async def test_a_waiter_cancelled_just_before_a_departure_is_skipped_not_admitted() -> None:
    """A task cancelled while queued has its future cancelled at once, but leaves the queue only
    when it next runs: a departure in between must pass over it (seen with clients leaving a
    backlog of 400 at once: InvalidStateError, and a slot counted for nobody)."""
    gate, p = control(), pool()
    running = [await gate.enter(p, "t", "batch", 1) for _ in range(2)]
    gone = asyncio.create_task(gate.enter(p, "t", "batch", 1))
    kept = asyncio.create_task(gate.enter(p, "u", "batch", 1))
    await settle()
    gone.cancel()  # cancels the future it awaits at once; its handler runs on its next step
    gate.leave(running[0], None)  # in the same step: no InvalidStateError; `kept` takes the slot
    held = await asyncio.wait_for(kept, 30)
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert gate.models["m"].inflight == 2 and gate.models["m"].total == 0
    gate.leave(held, None)
    gate.leave(running[1], None)
    assert gate.models["m"].inflight == 0


def test_waits_of_zero_are_counted_once_and_land_in_the_histograms_first_bucket() -> None:
    from server.gateway.flow.tally import WAIT_BUCKETS, FlowTally

    tally = FlowTally()
    for _ in range(3):
        tally.admitted("m", "batch", "t", 0.0)  # room: the path of most requests
    tally.admitted("m", "batch", "t", 0.3)
    tally.shed("m", "batch", "t", "queue_timeout", 2.0)
    tally.admitted("m", "interactive", "u", 0.0)
    assert tally.admitted_total["m", "batch", "t", "false"] == 3
    assert tally.admitted_total["m", "batch", "t", "true"] == 1
    histograms = tally.wait_histograms()
    batch = histograms["m", "batch", "t"]
    assert batch.counts[0] == 3
    assert batch.counts[WAIT_BUCKETS.index(0.5)] == 1 and batch.counts[WAIT_BUCKETS.index(2.0)] == 1
    assert sum(batch.counts) == 5 and batch.sum == 2.3
    assert histograms["m", "interactive", "u"].counts[0] == 1 and histograms["m", "interactive", "u"].sum == 0.0
    assert tally.waits["m", "batch", "t"].counts[0] == 0  # the tally itself is not changed by the scrape
