"""What a request costs a replica before its first token, in seconds, from the engine's own figures;
and each replica's requests in flight, so routing can tell how long a new one would wait there.

Cache-aware routing trades two things measured in different units: prompt tokens a replica's
prefix cache already holds (it need not compute them) and requests already in flight there (a new
one waits while the engine prefills them). To weigh one against the other the scorer needs both in
seconds (scoring.py, the wait rule). `PrefillCost` reads them off what the engine reports over its
life (scraped from /metrics): seconds of prefill over the prompt tokens it computed (looked up in
its prefix cache and not found), and its mean time to first token, of which what the computed
tokens do not explain is a fixed part (the request's preparation, the scheduler's step). On the
tiny model on one CPU core: about 18 ms plus 2.4 ms a block of 128 tokens; on a GPU, far less per
token.

`InFlight` is one replica's requests sent and not yet answered, oldest first, with when each was
sent and how many prompt tokens it had to compute; `left` is the expected seconds of their work
before their first tokens still ahead of a request sent now. After its first token a request
decodes, and a batching engine runs a newcomer's prefill beside that; it cannot run it beside a
prefill that is still going. Requests are assumed to end in the order they were sent (at the low
concurrency where the wait rule matters, nearly always true).

Pure, no I/O; the caller passes the clock and the figures.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from server.gateway.replicas.engine import EngineMetrics

MIN_TOKENS = 1024.0  # computed prompt tokens an engine must report before its cost per token is trusted


@dataclass(frozen=True, slots=True)
class PrefillCost:
    """Seconds to a request's first token on one engine: `fixed` + `per_token` x the tokens it computes."""

    per_token: float = 0.0
    fixed: float = 0.0

    @classmethod
    def of(cls, metrics: EngineMetrics) -> PrefillCost | None:
        """From the engine's lifetime figures; None until it has computed MIN_TOKENS prompt tokens."""
        queried, hit = metrics.prefix_queries_tokens, metrics.prefix_hits_tokens
        prefill, first, requests = metrics.prefill_seconds, metrics.first_token_seconds, metrics.first_tokens
        if queried is None or hit is None or prefill is None or first is None or requests is None:
            return None
        computed = queried - hit
        if computed < MIN_TOKENS or requests <= 0 or prefill < 0 or first < 0:
            return None
        per_token = prefill / computed
        return cls(per_token, max(0.0, (first - per_token * computed) / requests))

    def seconds(self, tokens: float) -> float:
        """The expected time to the first token of a request that computes `tokens` prompt tokens."""
        return self.fixed + self.per_token * max(0.0, tokens)


@dataclass
class InFlight:
    """One replica's requests in flight, oldest first: (sent at, prompt tokens it computes)."""

    requests: deque[tuple[float, float]] = field(default_factory=deque)

    def sent(self, at: float, tokens: float) -> None:
        self.requests.append((at, tokens))

    def ended(self) -> None:
        """The oldest request ended (its answer is over)."""
        if self.requests:
            self.requests.popleft()

    def left(self, cost: PrefillCost | None, now: float) -> float:
        """Expected seconds of the requests' work before their first tokens still ahead of a
        request sent now (0 when the engine's cost is not known yet)."""
        if cost is None:
            return 0.0
        return sum(max(0.0, cost.seconds(tokens) - (now - sent)) for sent, tokens in self.requests)

    def __len__(self) -> int:
        return len(self.requests)
