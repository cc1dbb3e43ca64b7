"""The gate in front of a model's engines: straight through while they have room, else a queue
ordered by class, then by fair share between tenants, admitted as room appears.

    Exchange._forward ─► FlowControl.enter(pool, tenant, class, cost) ─► (room) admitted at once
                                     │ (saturated: flow.saturation)
                                     └► queue[class][tenant] ─► admitted by `_dispatch` when a request
                                        leaves, an engine comes back, or the tick (`tick_s`) sees room
    ... pool.route (the cache-aware router picks the replica) ... answer ... FlowControl.leave(pass, usage)

Order: the highest class with anyone waiting; in it the tenant with the smallest virtual counter
(flow.fairshare); a tenant's own requests first come first served. Work-conserving: whenever a
request leaves (or capacity grows) and there is room, the next one is admitted in the same step;
a newcomer never passes a waiting request. Bounds (settings `Flow`): a class's queue at its length,
or every queue together at `max_queued_total` (then a newcomer takes the place of the newest
request of a lower class: batch is shed first, interactive last), or a request waiting past its
class's `max_wait`: 429 with Retry-After. A client that leaves while queued (its task cancelled by
proxy.deadlines) is taken out of the queue: nothing reaches the engine.

State is this process's own (one event loop, no locks: nothing between a check and its change
awaits). With `--workers N` each worker queues its own requests against its share of the
engines' batch (flow.saturation); docs/operate/flow-control.md says what that means.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any

from server.gateway.flow.classes import CLASSES, RANK, Class
from server.gateway.flow.errors import QueueRefused
from server.gateway.flow.fairshare import PromptCosts, VirtualCounters, prompt_charge
from server.gateway.flow.saturation import capacity
from server.gateway.flow.tally import FlowTally
from server.gateway.observability.record import cached_count, token_counts
from server.gateway.replicas.pool import ModelPool
from server.gateway.settings import Flow

log = logging.getLogger("gateway.flow")
DEFAULT_WAIT: dict[str, float] = {str(k): v for k, v in Flow().max_wait.items()}  # a class left out: its default
DEFAULT_QUEUED: dict[str, int] = {str(k): v for k, v in Flow().max_queued.items()}


@dataclass(eq=False, slots=True)
class Waiter:
    """One request waiting at the gate."""

    tenant: str
    klass: Class
    cost: float
    arrived: float
    future: asyncio.Future[None]
    shed: QueueRefused | None = None  # set when a higher class took its place


@dataclass(eq=False, slots=True)
class Pass:
    """An admitted request: what it was charged and how long it waited (`leave` settles it)."""

    model: str
    tenant: str
    klass: Class
    charged: float
    waited: float
    admitted_at: float
    left: bool = False
    chars: int = 0  # the prompt's characters (flow.gate learns characters per token from usage)
    booked: bool = True  # False: let in by `pass_now`, its charge and count not yet made (`book`)


@dataclass(eq=False)
class ModelQueue:
    """One model's gate: its in-flight count and its queues by class, then tenant."""

    pool: ModelPool
    inflight: int = 0
    by_class: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CLASSES, 0))  # in flight per class
    queued: dict[str, dict[str, deque[Waiter]]] = field(default_factory=lambda: {c: {} for c in CLASSES})
    lengths: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CLASSES, 0))
    waiting: int = 0  # every class's length together (what the path with room checks first)
    service_s: float = 1.0  # moving average of an admitted request's time at the engine (Retry-After)

    @property
    def total(self) -> int:
        return self.waiting

    def waiting_tenants(self) -> set[str]:
        return {tenant for tenants in self.queued.values() for tenant in tenants}


class FlowControl:
    """Every served model's gate (see the module doc); one per gateway process."""

    def __init__(
        self,
        settings: Flow,
        *,
        max_num_seqs: Mapping[str, int | None] | None = None,
        workers: int = 1,
        wait_cap: float | None = None,
        priority_models: frozenset[str] = frozenset(),
        clock: Callable[[], float] = perf_counter,
    ) -> None:
        self.settings = settings
        self.workers = workers
        self.priority_models = priority_models  # models whose engines schedule by priority (vLLM)
        self.wait_cap = wait_cap  # the first-byte deadline, which the wait counts toward (proxy.deadlines)
        self.clock = clock
        self._max_num_seqs = dict(max_num_seqs or {})
        self._batch: dict[str, int] = {}  # model -> max_num_seqs(model), worked out once
        self.counters = VirtualCounters()
        self.prompt_costs = PromptCosts()
        self.tally = FlowTally()
        self.models: dict[str, ModelQueue] = {}
        self._tick: asyncio.TimerHandle | None = None

    def max_num_seqs(self, model: str) -> int:
        """The engines' batch size for `model`: the settings', else its profile's, else vLLM's default."""
        batch = self._batch.get(model)
        if batch is None:
            batch = self._batch[model] = self.settings.max_num_seqs or self._max_num_seqs.get(model) or 256
        return batch

    def capacity(self, pool: ModelPool) -> int:
        return capacity(pool.engines, self.max_num_seqs(pool.name), self.settings.kv_usage_limit, self.workers)

    def _queue(self, pool: ModelPool) -> ModelQueue:
        queue = self.models.get(pool.name)
        if queue is None or queue.pool is not pool:
            queue = self.models[pool.name] = ModelQueue(pool)
        return queue

    # -- the request's side -----------------------------------------------------------------------

    def pass_now(self, pool: ModelPool, tenant: str, klass: Class, reserve: float) -> Pass | None:
        """Admit at once when the model has room and nobody waits (or it has no engine: routing
        answers 503), else None (then `enter`). The pass takes its room now; its charge, `reserve`
        (flow.gate: the output it may write) plus what the tenant's prompts cost lately (its prompt
        is not read on this path), is booked by `book` once the engine has the request, and the
        answer settles it: a tenant whose requests went straight in while there was room has its
        counter show them while they are in flight, prompts included, so a tenant that starts
        waiting beside it is lifted to a counter that counts them."""
        queue = self.models.get(pool.name)
        if queue is None or queue.pool is not pool:
            queue = self._queue(pool)
        if queue.waiting or (self._room(queue, klass) <= 0 and pool.healthy_count):
            return None
        queue.inflight += 1  # (its room is taken now; the rest of `_admit` is `book`, made while the engine works)
        queue.by_class[klass] += 1
        return Pass(pool.name, tenant, klass, reserve, 0.0, self.clock(), booked=False)

    def book(self, held: Pass) -> None:
        """A request `pass_now` let in: charge its tenant's counter its reservation plus what the
        tenant's prompts cost lately, and count it admitted. The gateway calls this once the request
        is written to the engine (GatewayRequest.sent), so the work overlaps the engine's; `settle`
        calls it if nothing did. A tenant that starts waiting in between (a few microseconds: the
        request is already on its way) is lifted to a counter without this request."""
        if held.booked:
            return
        held.booked = True
        model, tenant = held.model, held.tenant
        held.charged += self.prompt_costs.expect(model, tenant)
        self.counters.charge(tenant, held.charged)
        self.tally.admitted(model, held.klass, tenant, 0.0)

    async def enter(self, pool: ModelPool, tenant: str, klass: Class, cost: float) -> Pass:
        """Wait until `pool`'s engines have room for this request (at once when they do); raises
        QueueRefused, or CancelledError when the request's task is cancelled while it waits."""
        queue = self._queue(pool)
        now = self.clock()
        if not queue.total and (self._room(queue, klass) > 0 or not pool.healthy_count):
            return self._admit(queue, tenant, klass, cost, 0.0)  # room (or no engine: routing says 503)
        self._make_room(queue, tenant, klass)
        self.counters.lift(tenant, queue.waiting_tenants())
        waiter = Waiter(tenant, klass, cost, now, asyncio.get_running_loop().create_future())
        queue.queued[klass].setdefault(tenant, deque()).append(waiter)
        queue.lengths[klass] += 1
        queue.waiting += 1
        self._dispatch(queue)
        if not waiter.future.done():
            self._arm_tick()
        limit = self._wait_limit(klass)
        try:
            async with asyncio.timeout(limit):
                await waiter.future
        except TimeoutError:
            if waiter.shed is not None:
                raise waiter.shed from None
            if not _admitted(waiter):  # (an admission that raced the timeout stands)
                self._remove(queue, waiter)
                self.tally.shed(pool.name, klass, tenant, "queue_timeout", self.clock() - now)
                raise QueueRefused(
                    f"The engines for model `{pool.name}` stayed full for {limit:g} s, the longest a "
                    f"`{klass}` request waits at the gateway; retry later.",
                    "queue_timeout",
                    self._retry_after(queue),
                ) from None
        except asyncio.CancelledError:
            if _admitted(waiter):
                self.leave(self._pass_of(pool.name, waiter, now), None)  # admitted as it was cancelled
            elif waiter.shed is None:
                self._remove(queue, waiter)
                self.tally.shed(pool.name, klass, tenant, "client_left", self.clock() - now)
            raise
        if waiter.shed is not None:
            raise waiter.shed
        return self._pass_of(pool.name, waiter, now)

    def leave(self, held: Pass, usage: Mapping[str, Any] | None) -> None:
        """The admitted request is over: its tenant's counter is settled from the engine's usage
        (the reservation stands when there is none) and the next waiting request may go."""
        if isinstance(usage, dict):
            prompt, completion = token_counts(usage)
            self.settle(held, prompt, completion, cached_count(usage))
        else:
            self.settle(held, None, None, 0)

    def settle(self, held: Pass, prompt: int | None, completion: int | None, cached: int) -> None:
        """`leave` with the usage's tokens already read (observability.record: RequestRecord.tokens)."""
        if held.left:
            return
        if not held.booked:
            self.book(held)
        held.left = True
        model = held.model
        if prompt is not None or completion is not None:
            uncached = prompt_charge(prompt or 0, cached)
            if prompt is not None:
                self.prompt_costs.settled(model, held.tenant, uncached)
            actual = uncached + (completion or 0)
            self.counters.charge(held.tenant, actual - held.charged)
            self.tally.served(model, held.tenant, actual)
        queue = self.models.get(model)
        if queue is None:
            return
        queue.inflight -= 1
        queue.by_class[held.klass] -= 1
        queue.service_s += 0.1 * ((self.clock() - held.admitted_at) - queue.service_s)
        if queue.waiting:
            self._dispatch(queue)

    # -- the queue's side -------------------------------------------------------------------------

    def _room(self, queue: ModelQueue, klass: Class) -> int:
        """Requests of `klass` the model takes now. Batch leaves `headroom` free for the classes
        above. Engines that schedule by priority (vLLM's priority policy: a higher class is
        scheduled first from its queue) count only the requests in flight of `klass` and above:
        a higher class goes in beside a full lower one and is next at the engine; other engines
        count every request in flight. On those engines a KV cache at the limit holds only the
        lowest class in flight: when a running request needs a block the cache lacks, vLLM's
        priority policy preempts the lowest-priority running request (and, of those waiting,
        schedules the highest first), so a higher class sent beside a full cache of a lower one
        takes its space instead of waiting at the gateway for a lower answer to end."""
        pool, limit, counted = queue.pool, self.settings.kv_usage_limit, queue.inflight
        if self.priority_models and pool.name in self.priority_models:
            rank = RANK[klass]
            if any(n for k, n in queue.by_class.items() if RANK[k] > rank):
                limit = math.inf  # a lower class in flight makes way
            counted = sum(n for k, n in queue.by_class.items() if RANK[k] <= rank)
        cap = capacity(pool.engines, self.max_num_seqs(pool.name), limit, self.workers)
        if klass == "batch":
            cap -= self.headroom(cap)
        return cap - counted

    def headroom(self, cap: int) -> int:
        """Slots of `cap` batch requests leave to the classes above: vLLM's scheduler preempts
        only when its KV cache is short, never because its batch of sequences is full, so an
        interactive request behind a full batch would wait for a batch answer to end."""
        share = self.settings.batch_headroom
        return min(math.ceil(share * cap), cap - 1) if share > 0 and cap > 1 else 0

    def _admit(self, queue: ModelQueue, tenant: str, klass: Class, cost: float, waited: float) -> Pass:
        queue.inflight += 1
        queue.by_class[klass] += 1
        self.counters.charge(tenant, cost)
        model = queue.pool.name
        self.tally.admitted(model, klass, tenant, waited)
        return Pass(model, tenant, klass, cost, waited, self.clock())

    def _pass_of(self, model: str, waiter: Waiter, arrived: float) -> Pass:
        now = self.clock()
        return Pass(model, waiter.tenant, waiter.klass, waiter.cost, now - arrived, now)

    def _dispatch(self, queue: ModelQueue) -> None:
        """Admit waiting requests, in order, while the model has room (or has no engine at all).
        Room for the next in order is room for it or for nobody (a lower class has no more)."""
        while queue.total:
            waiter = self._peek(queue)
            if waiter.future.done():  # its task was cancelled (client left, wait limit) and has not run yet
                self._remove(queue, waiter)
                continue
            if self._room(queue, waiter.klass) <= 0 and queue.pool.healthy_count:
                return
            self._remove(queue, waiter)
            queue.inflight += 1
            queue.by_class[waiter.klass] += 1
            self.counters.charge(waiter.tenant, waiter.cost)
            self.tally.admitted(queue.pool.name, waiter.klass, waiter.tenant, self.clock() - waiter.arrived)
            waiter.future.set_result(None)

    def _peek(self, queue: ModelQueue) -> Waiter:
        """The next request in order: highest class, then smallest virtual counter, then first come."""
        for klass in CLASSES:
            tenants = queue.queued[klass]
            if tenants:
                counters = self.counters
                tenant = min(tenants, key=lambda t: (counters.get(t), tenants[t][0].arrived))
                return tenants[tenant][0]
        raise AssertionError("_peek on an empty queue")

    def _remove(self, queue: ModelQueue, waiter: Waiter) -> None:
        waiters = queue.queued[waiter.klass].get(waiter.tenant)
        if waiters is None or waiter not in waiters:
            return
        waiters.remove(waiter)
        if not waiters:
            del queue.queued[waiter.klass][waiter.tenant]
        queue.lengths[waiter.klass] -= 1
        queue.waiting -= 1

    def _make_room(self, queue: ModelQueue, tenant: str, klass: Class) -> None:
        """Refuse the newcomer when its class's queue is full; when every queue together is full,
        shed the newest request of the lowest class below the newcomer's, else refuse it."""
        settings = self.settings
        model = queue.pool.name
        if queue.lengths[klass] >= settings.max_queued.get(klass, DEFAULT_QUEUED[klass]):
            self.tally.shed(model, klass, tenant, "queue_full", 0.0)
            raise QueueRefused(
                f"The engines for model `{model}` are full and {queue.lengths[klass]} `{klass}` requests "
                "already wait at the gateway; retry later.",
                "queue_full",
                self._retry_after(queue),
            )
        if queue.total < settings.max_queued_total:
            return
        for lower in reversed(CLASSES):
            if RANK[lower] <= RANK[klass]:
                break
            tenants = queue.queued[lower]
            if tenants:
                live = [w for ws in tenants.values() for w in ws if not w.future.done()]
                if not live:
                    continue
                victim = max(live, key=lambda w: w.arrived)
                self._remove(queue, victim)
                victim.shed = QueueRefused(
                    f"The engines for model `{model}` are full and a request of a higher class took this "
                    f"`{lower}` request's place in the gateway's queue; retry later.",
                    "queue_displaced",
                    self._retry_after(queue),
                )
                self.tally.shed(model, lower, victim.tenant, "displaced", self.clock() - victim.arrived)
                victim.future.set_result(None)
                return
        self.tally.shed(model, klass, tenant, "queue_full", 0.0)
        raise QueueRefused(
            f"The engines for model `{model}` are full and the gateway's queue holds "
            f"{queue.total} requests; retry later.",
            "queue_full",
            self._retry_after(queue),
        )

    def _wait_limit(self, klass: Class) -> float:
        limit = self.settings.max_wait.get(klass, DEFAULT_WAIT[klass])
        return min(limit, 0.95 * self.wait_cap) if self.wait_cap else limit

    def _retry_after(self, queue: ModelQueue) -> int:
        """Seconds until about the queue ahead has gone through the engines once (1..60)."""
        cap = max(1, self.capacity(queue.pool))
        return max(1, min(60, math.ceil(queue.service_s * (1 + queue.total / cap))))

    def _arm_tick(self) -> None:
        """While anything waits, look for room every `tick_s`: capacity also grows without a request
        leaving (an engine back up, KV usage down in a scrape)."""
        if self._tick is None:
            self._tick = asyncio.get_running_loop().call_later(self.settings.tick_s, self._on_tick)

    def _on_tick(self) -> None:
        self._tick = None
        waiting = False
        for queue in self.models.values():
            self._dispatch(queue)
            waiting = waiting or bool(queue.total)
        if waiting:
            self._arm_tick()


def _admitted(waiter: Waiter) -> bool:
    """The gate let `waiter` through (not shed, not cancelled while waiting)."""
    future = waiter.future
    return future.done() and not future.cancelled() and waiter.shed is None
