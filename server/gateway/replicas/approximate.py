"""The approximate prefix index: which prompt blocks the gateway has sent to each replica.

It guesses what an engine's prefix cache holds from routing history alone, as llm-d's
`prefix-cache-scorer` and SGLang's `cache_aware` do: every request routed to a replica records
its prompt's blocks there (server.gateway.replicas.blocks: text blocks, no tokenizer), so it works
in front of any engine, by URL too. A prompt the gateway salts (vLLM's `cache_salt`, a tenant's
`cache_isolation: tenant`) has its blocks chained from the salt (blocks.namespace), so the record
never counts one tenant's blocks for another's equal prompt. Recording at routing time is also what keeps a burst of
identical prompts together: the second one already sees the first one's blocks.

Per replica, an LRU record with bounded memory: at most `capacity` blocks (the oldest go first,
as the engine's own LRU would evict them) and none older than `ttl` seconds. It drifts from the
engine's truth after evictions the gateway cannot see; the precise index (precise.py) does not.
State only: the caller passes the clock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from server.gateway.replicas.blocks import BlockKey

DEFAULT_CAPACITY = 65_536  # blocks per replica when the engine's cache size is unknown


class ApproximateIndex:
    """Per replica: the blocks recently sent to it, most recent last."""

    def __init__(self, *, ttl: float = 600.0, capacity: int = DEFAULT_CAPACITY) -> None:
        self.ttl = ttl
        self.default_capacity = capacity
        self._records: dict[str, OrderedDict[BlockKey, float]] = {}  # engine id -> block -> last sent
        self._capacity: dict[str, int] = {}

    def set_capacity(self, engine: str, blocks: int) -> None:
        """Keep at most `blocks` blocks for `engine` (about what its KV cache holds)."""
        self._capacity[engine] = max(1, blocks)
        self._trim(engine, None)

    def capacity(self, engine: str) -> int:
        return self._capacity.get(engine, self.default_capacity)

    def record(self, engine: str, blocks: Sequence[BlockKey], now: float) -> None:
        """A prompt of these blocks was just sent to `engine`."""
        record = self._records.setdefault(engine, OrderedDict())
        for key in blocks:
            record[key] = now
            record.move_to_end(key)
        self._trim(engine, now)

    def matched(self, engine: str, blocks: Sequence[BlockKey], now: float) -> int:
        """How many of the leading `blocks` were sent to `engine` within the last `ttl` seconds."""
        record = self._records.get(engine)
        if not record:
            return 0
        oldest = now - self.ttl
        count = 0
        for key in blocks:
            sent = record.get(key)
            if sent is None or sent < oldest:
                break
            count += 1
        return count

    def held(self, engine: str) -> int:
        """Blocks recorded for `engine` (expired ones may still count until the next record)."""
        return len(self._records.get(engine, ()))

    def forget(self, engine: str) -> None:
        """Drop everything recorded for `engine` (it restarted: its cache is empty)."""
        self._records.pop(engine, None)

    def _trim(self, engine: str, now: float | None) -> None:
        record = self._records.get(engine)
        if record is None:
            return
        limit = self.capacity(engine)
        while len(record) > limit:
            record.popitem(last=False)
        if now is not None:
            oldest = now - self.ttl
            while record:
                key, sent = next(iter(record.items()))
                if sent >= oldest:
                    break
                del record[key]
