"""Open-loop arrival schedules: when each new request (or session) is due.

Gamma-distributed gaps with shape `burstiness` and mean `1/rate`, as vLLM's `bench serve`
draws them: `burstiness=1` is a Poisson process (exponential gaps, coefficient of variation 1),
smaller is burstier, larger is smoother (CV = 1/sqrt(burstiness)); `constant` is evenly spaced.
Unlike vLLM the gaps are not renormalised to a fixed span: the schedule is an honest random
process, so it also works for duration-based runs of unknown length.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

ARRIVALS = ("poisson", "gamma", "constant")


def gaps(rate: float, *, arrival: str = "poisson", burstiness: float = 1.0, rng: random.Random) -> Iterator[float]:
    """Endless gaps (seconds) between consecutive arrivals at mean `rate` per second."""
    if rate <= 0:
        raise ValueError("rate must be positive")
    if arrival == "constant":
        while True:
            yield 1.0 / rate
    if arrival == "poisson":
        burstiness = 1.0
    elif arrival != "gamma":
        raise ValueError(f"unknown arrival process {arrival!r} ({', '.join(ARRIVALS)})")
    if burstiness <= 0:
        raise ValueError("burstiness must be positive")
    scale = 1.0 / (rate * burstiness)
    while True:
        yield rng.gammavariate(burstiness, scale)


def arrival_times(
    rate: float, *, arrival: str = "poisson", burstiness: float = 1.0, rng: random.Random
) -> Iterator[float]:
    """Endless arrival offsets from the start of the run; the first arrival is at 0."""
    offset = 0.0
    for gap in gaps(rate, arrival=arrival, burstiness=burstiness, rng=rng):
        yield offset
        offset += gap
