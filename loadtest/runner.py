"""Drives one run: one target, one load shape, until a stop rule says enough.

Load shapes (README "Load testing"):

- **closed loop** (`concurrency=N`, no rate): N simulated users; each sends its session's turns
  one after another (next turn when the answer has arrived, plus think time) and starts a new
  session when its session is over.
- **open loop** (`rate=R`): sessions start at arrival times drawn from `loadtest.schedule`;
  with `concurrency=N` as well, at most N requests are in flight and the others wait (their
  wait shows up as schedule lateness).

Each request takes a ticket just before it is due; tickets decide the phase (warm-up or
measured) and stop the run (`num_requests` measured requests, or `duration_s` seconds after
the first measured request). Requests in flight when the run stops are awaited, never cut.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from loadtest.client import ChatClient
from loadtest.engine_probe import EngineProbe, counter_deltas, during
from loadtest.loop_lag import LoopLagMonitor
from loadtest.process_stats import GCPauses, ProcessSample, frozen_gc
from loadtest.records import RequestRecord
from loadtest.scenarios import Session
from loadtest.schedule import arrival_times


@dataclass(frozen=True)
class LoadShape:
    """Closed-loop `concurrency`, or open-loop `rate` (req/s) with `concurrency` as a ceiling."""

    concurrency: int | None = None
    rate: float | None = None
    arrival: str = "poisson"
    burstiness: float = 1.0

    def __post_init__(self) -> None:
        if self.rate is None and not self.concurrency:
            raise ValueError("a load shape needs a concurrency or a rate")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        if self.rate is not None and self.rate <= 0:
            raise ValueError("rate must be positive")

    @property
    def label(self) -> str:
        if self.rate is None:
            return f"concurrency {self.concurrency}"
        shape = self.arrival if self.arrival != "gamma" else f"gamma, burstiness {self.burstiness:g}"
        ceiling = f", ceiling {self.concurrency}" if self.concurrency else ""
        return f"rate {self.rate:g}/s ({shape}{ceiling})"

    def to_json(self) -> dict:
        return {
            "concurrency": self.concurrency,
            "rate": self.rate,
            "arrival": self.arrival,
            "burstiness": self.burstiness,
            "label": self.label,
        }


@dataclass(frozen=True)
class StopRule:
    """When a run ends, and which of its first requests are warm-up (excluded from metrics)."""

    num_requests: int | None = None
    duration_s: float | None = None
    warmup_requests: int = 0
    warmup_s: float = 0.0

    def __post_init__(self) -> None:
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError("num_requests must be at least 1")
        if self.duration_s is not None and self.duration_s <= 0:
            raise ValueError("duration must be positive")


@dataclass
class RunResult:
    """The records of one run and what was observed around it."""

    target: str
    run: str
    shape: LoadShape
    records: list[RequestRecord]
    wall_s: float
    engine: dict = field(default_factory=dict)  # counter deltas from --metrics-url
    loop_lag: dict = field(default_factory=dict)  # the generator's own event-loop lag
    process: dict = field(default_factory=dict)  # the generator's CPU, run-queue wait, GC pauses
    origin: float = 0.0  # the run's start on the runner's clock (time.perf_counter())

    @property
    def measured(self) -> list[RequestRecord]:
        return [r for r in self.records if r.phase == "measure"]


@dataclass(frozen=True)
class Target:
    """One server under test: its label in reports, its client, its optional engine probe."""

    label: str
    client: ChatClient
    probe: EngineProbe | None = None


class Runner:
    """Runs `sessions` against `client` with `shape` until `stop`; see the module docstring.

    With `paired_with`, every turn is sent to both targets back to back by the same simulated
    user (each target keeps its own conversation history; the order alternates per session),
    so slow drifts of a shared, noisy machine hit both alike: a paired A/B.

    The garbage collector is frozen during the run (`process_stats.frozen_gc`; `freeze_gc=False`
    keeps the interpreter's default, for `loadtest.selfcheck`'s before/after).
    """

    def __init__(
        self,
        client: ChatClient,
        sessions: Iterable[Session],
        shape: LoadShape,
        stop: StopRule,
        *,
        target: str = "A",
        run: str = "run",
        think_time_s: float = 0.0,
        end_session_on_error: bool = False,
        seed: int = 0,
        probe: EngineProbe | None = None,
        paired_with: Target | None = None,
        on_record: Callable[[RequestRecord], None] | None = None,
        freeze_gc: bool = True,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._targets = [Target(target, client, probe)] + ([paired_with] if paired_with else [])
        self._sessions = iter(sessions)
        self._shape = shape
        self._stop = stop
        self._run = run
        self._think_time_s = think_time_s
        self._end_session_on_error = end_session_on_error
        self._seed = seed
        self._on_record = on_record
        self._freeze_gc = freeze_gc
        self._clock = clock
        self._records: list[RequestRecord] = []
        self._issued = 0
        self._measured = 0
        self._sessions_started = 0
        self._measure_start: float | None = None
        self._stopping = False
        self._origin = 0.0
        self._ceiling: asyncio.Semaphore | None = None

    async def run(self) -> RunResult:
        """Run a single target (see `run_all` for paired runs)."""
        return (await self.run_all())[0]

    async def run_all(self) -> list[RunResult]:
        """Run; one result per target."""
        probes = [t.probe for t in self._targets]
        before = [await p.scrape() if p else None for p in probes]
        with frozen_gc(self._freeze_gc):
            self._origin = self._clock()
            monitor, pauses, started = LoopLagMonitor(clock=self._clock), GCPauses(), ProcessSample.take()
            monitor.start()
            pauses.start()
            try:
                for probe in probes:
                    if probe:
                        probe.start_sampling(self._origin)
                if self._shape.rate is None:
                    workers = [asyncio.create_task(self._user()) for _ in range(self._shape.concurrency)]
                    await _gather_all(workers)
                else:
                    if self._shape.concurrency:
                        self._ceiling = asyncio.Semaphore(self._shape.concurrency)
                    await self._open_loop()
                wall = self._clock() - self._origin
            finally:
                loop_lag = await monitor.stop()
                process = {f"generator_{k}": v for k, v in ProcessSample.take().since(started).items()}
                process.update(pauses.stop())
        results = []
        for target, start in zip(self._targets, before):
            records = sorted((r for r in self._records if r.target == target.label), key=lambda r: r.sent_s)
            engine = await self._engine_summary(target.probe, start, records)
            results.append(
                RunResult(target.label, self._run, self._shape, records, wall, engine, loop_lag, process, self._origin)
            )
        return results

    async def _engine_summary(
        self, probe: EngineProbe | None, before: dict | None, records: list[RequestRecord]
    ) -> dict:
        if probe is None:
            return {}
        await probe.stop_sampling()
        for record in records:
            record.engine = during(probe.samples, record.sent_s, record.end_s)
        after = await probe.scrape()
        engine: dict = {}
        if before is not None and after is not None:
            engine = counter_deltas(before, after)
        engine["samples"] = [
            [
                round(s.start, 4),
                s.values.get("vllm:kv_cache_usage_perc"),
                s.values.get("vllm:num_requests_running"),
                s.values.get("vllm:num_requests_waiting"),
            ]
            for s in probe.samples
        ]
        return engine

    def _ticket(self) -> tuple[int, str] | None:
        """(index, phase) for the next request, or None when the run is over."""
        if self._stopping:
            return None
        now = self._clock()
        index = self._issued
        stop = self._stop
        warm = index < stop.warmup_requests or (now - self._origin) < stop.warmup_s
        if not warm:
            if stop.num_requests is not None and self._measured >= stop.num_requests:
                self._stopping = True
                return None
            if self._measure_start is None:
                self._measure_start = now
            if stop.duration_s is not None and now - self._measure_start >= stop.duration_s:
                self._stopping = True
                return None
            self._measured += 1
        self._issued += 1
        return index, "warmup" if warm else "measure"

    def _next_session(self) -> Session | None:
        if self._stopping:
            return None
        session = next(self._sessions, None)
        if session is None:
            self._stopping = True
        return session

    async def _user(self) -> None:
        """One closed-loop user: sessions back to back until the run stops."""
        while (session := self._next_session()) is not None:
            await self._session(session, self._clock(), None)

    async def _open_loop(self) -> None:
        tasks: set[asyncio.Task] = set()
        rng = random.Random(f"{self._seed}:arrivals")
        arrivals = arrival_times(
            self._shape.rate, arrival=self._shape.arrival, burstiness=self._shape.burstiness, rng=rng
        )
        try:
            for offset in arrivals:
                due = self._origin + offset
                delay = due - self._clock()
                if delay > 0:
                    await asyncio.sleep(delay)
                session = self._next_session()
                if session is None:
                    break
                ticket = self._ticket()
                if ticket is None:
                    break
                task = asyncio.create_task(self._session(session, due, ticket))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        finally:
            await _gather_all(list(tasks))

    async def _session(self, session: Session, scheduled: float, ticket: tuple[int, str] | None) -> None:
        order = list(self._targets)
        if self._sessions_started % 2:
            order.reverse()  # paired runs: alternate who goes first
        self._sessions_started += 1
        histories: dict[str, list[dict] | None] = {t.label: [] for t in order}
        for turn, (message, max_tokens) in enumerate(zip(session.turns, session.max_tokens)):
            ticket = ticket or self._ticket()
            if ticket is None:
                return
            index, phase = ticket
            ticket = None
            failed = False
            for target in order:
                if histories[target.label] is None:
                    continue  # this target's session was abandoned after an error
                record = RequestRecord(
                    request_id=f"{_slug(target.label)}-{_slug(self._run)}-{index}",
                    target=target.label,
                    run=self._run,
                    phase=phase,
                    session_id=session.id,
                    turn=turn,
                    max_tokens=max_tokens,
                    scheduled_s=scheduled - self._origin,
                )
                history = histories[target.label]
                messages = [*session.prefix, *history, message]
                async with self._ceiling or contextlib.nullcontext():
                    answer = await target.client.stream(
                        record,
                        messages,
                        origin=self._origin,
                        on_first_token=target.probe.sample if target.probe else None,
                    )
                self._records.append(record)
                if self._on_record is not None:
                    self._on_record(record)
                if record.ok:
                    history += [message, {"role": "assistant", "content": answer.text}]
                elif self._end_session_on_error:
                    histories[target.label] = None
                    failed = True
                scheduled = self._clock()
            if failed and all(h is None for h in histories.values()):
                return
            scheduled = self._clock() + self._think_time_s
            if self._think_time_s > 0:
                await asyncio.sleep(self._think_time_s)


async def _gather_all(tasks: list[asyncio.Task]) -> None:
    """Await every task; on cancellation cancel them all and wait for them to close."""
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in text).strip("-").lower()
