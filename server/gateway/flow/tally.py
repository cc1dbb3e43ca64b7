"""What the gate did, counted in this process for its metrics (flow.metrics): requests admitted
and shed, their waits, the tokens served, by model, class and tenant (labels bounded by the
configured tenants and the served models)."""

from __future__ import annotations

from bisect import bisect_left
from collections import defaultdict
from dataclasses import dataclass, field

# Seconds waited at the gate: 0 (room) to minutes (a batch behind a long backlog).
WAIT_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)


@dataclass(slots=True)
class WaitHistogram:
    counts: list[int] = field(default_factory=lambda: [0] * (len(WAIT_BUCKETS) + 1))
    sum: float = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(WAIT_BUCKETS, seconds)] += 1
        self.sum += seconds


class FlowTally:
    """Counters and wait histograms of the gate; plain dicts (one event loop, no locks)."""

    def __init__(self) -> None:
        # (model, class, tenant, queued "true"/"false") -> requests admitted
        self.admitted_total: dict[tuple[str, str, str, str], int] = defaultdict(int)
        # (model, class, tenant, reason) -> requests refused or dropped at the gate
        self.shed_total: dict[tuple[str, str, str, str], int] = defaultdict(int)
        self.waits: dict[tuple[str, str, str], WaitHistogram] = defaultdict(WaitHistogram)
        self.served_tokens: dict[tuple[str, str], int] = defaultdict(int)  # (model, tenant) -> charged tokens

    def admitted(self, model: str, klass: str, tenant: str, waited: float) -> None:
        if waited > 0:
            self.admitted_total[model, klass, tenant, "true"] += 1
            self.waits[model, klass, tenant].observe(waited)
        else:  # the path of every request while there is room: its wait of 0 is read from this count
            self.admitted_total[model, klass, tenant, "false"] += 1

    def wait_histograms(self) -> dict[tuple[str, str, str], WaitHistogram]:
        """Every wait at the gate by (model, class, tenant): the observed ones, and the admissions
        without a wait in the first bucket (counted only in `admitted_total`, on the request path)."""
        out = {triple: WaitHistogram(list(h.counts), h.sum) for triple, h in self.waits.items()}
        for (model, klass, tenant, queued), count in self.admitted_total.items():
            if queued == "false":
                histogram = out.get((model, klass, tenant))
                if histogram is None:
                    histogram = out[model, klass, tenant] = WaitHistogram()
                histogram.counts[0] += count
        return out

    def shed(self, model: str, klass: str, tenant: str, reason: str, waited: float) -> None:
        self.shed_total[model, klass, tenant, reason] += 1
        if waited > 0:
            self.waits[model, klass, tenant].observe(waited)

    def served(self, model: str, tenant: str, tokens: int) -> None:
        self.served_tokens[model, tenant] += tokens
