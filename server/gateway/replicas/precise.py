"""The precise prefix index: which blocks each engine holds, as its own KV events say.

vLLM publishes `BlockStored` (block hashes, the parent's hash, the blocks' token ids, the block
size), `BlockRemoved` (hashes) and `AllBlocksCleared` (kv_events.py reads them). The index keys
each stored block by its token ids, chained from its parent's key (server.gateway.replicas.blocks),
and keeps the engine's hash -> our key map so a removal can find it: vLLM's own hash is never
reproduced (its default algorithm pickles Python objects). A prompt tokenized by the engine's
/tokenize is keyed the same way, so a lookup is exact, block for block, in the engine's block size
(learned from the events, which carry it). A chain that starts at a stored block without a
parent is rooted in its namespace: the LoRA adapter and the `cache_salt` vLLM hashed its first
block with (kv_events.py reads them from the event's `lora_name` and `extra_keys`), as a salted
prompt's /tokenize blocks are (cache.py, blocks.request_namespace): two tenants' equal prompts
are two chains here as they are two in the engine.

A stored block whose parent the index does not know (stored before the gateway was listening) is
skipped: it cannot be keyed. A `BlockRemoved` for an unknown hash is ignored.

After routing, `speculate` adds the request's blocks for `speculative_ttl` seconds, so a burst
of identical prompts does not scatter before the engine's events arrive (llm-d does the same).
A speculative entry ends as soon as the events speak of its block: stored, it is held; removed,
it is gone. Kept to its expiry instead, it outlived the block: at issue 34's pace (30 requests a
second, a cache of 48 blocks) a tenant's blocks were evicted within a few requests, and the index
still counted them held for the rest of the 2 s, so half of the requests it sent "home" to their
tenant's blocks (37 of 72 a phase) found only the shared prefix there.

`live` says whether the engine's events are being received (the subscriber is connected);
while not, routing uses the approximate index for that engine. `purge` forgets an engine's blocks
(sequence gap, reconnect, restart, AllBlocksCleared); what arrives after rebuilds them.
State only, no I/O; the caller passes the clock.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from server.gateway.replicas.blocks import BlockKey, key_bytes, root, token_blocks

log = logging.getLogger("gateway.kv_events")

MAX_BLOCKS = 1_000_000  # per engine; past this (events lost without a gap?) the engine is purged


@dataclass
class EngineBlocks:
    """What one engine's events have told: its blocks, by our key."""

    keys: dict[Hashable, BlockKey] = field(default_factory=dict)  # the engine's block hash -> our key
    held: dict[BlockKey, int] = field(default_factory=dict)  # our key -> engine hashes naming it
    speculative: OrderedDict[BlockKey, float] = field(default_factory=OrderedDict)  # our key -> expiry
    block_size: int | None = None  # from the events
    live: bool = False  # its events are being received (the subscriber is connected)
    stored: int = 0  # blocks stored, counted over the engine's life in this gateway
    removed: int = 0
    skipped: int = 0  # stored blocks that could not be keyed (unknown parent, odd sizes)
    purges: dict[str, int] = field(default_factory=dict)  # reason -> count


class PreciseIndex:
    """Per engine id: the blocks its KV events say it holds."""

    def __init__(self, *, speculative_ttl: float = 2.0, max_blocks: int = MAX_BLOCKS) -> None:
        self.speculative_ttl = speculative_ttl
        self.max_blocks = max_blocks
        self.engines: dict[str, EngineBlocks] = {}

    def state(self, engine: str) -> EngineBlocks:
        state = self.engines.get(engine)
        if state is None:
            state = self.engines[engine] = EngineBlocks()
        return state

    def is_live(self, engine: str) -> bool:
        state = self.engines.get(engine)
        return state is not None and state.live

    def set_live(self, engine: str, live: bool) -> None:
        self.state(engine).live = live

    def block_size(self, engine: str) -> int | None:
        state = self.engines.get(engine)
        return state.block_size if state is not None else None

    def held(self, engine: str) -> int:
        state = self.engines.get(engine)
        return len(state.held) if state is not None else 0

    # -- events --------------------------------------------------------------------------------

    def stored(
        self,
        engine: str,
        *,
        block_hashes: Sequence[Hashable],
        parent: Hashable | None,
        token_ids: Sequence[int],
        block_size: int,
        namespace: str = "",
    ) -> int:
        """A `BlockStored` event; returns how many blocks were keyed. `namespace` (blocks.namespace:
        the adapter and the salt) roots a chain without a parent."""
        state = self.state(engine)
        count = len(block_hashes)
        if count == 0 or block_size <= 0 or len(token_ids) != count * block_size:
            state.skipped += count
            return 0
        if state.block_size is not None and state.block_size != block_size:
            self.purge(engine, "block_size")  # the engine restarted with another block size
        state.block_size = block_size
        if parent is None:
            start = root(namespace)
        else:
            parent_key = state.keys.get(parent)
            if parent_key is None:
                state.skipped += count
                return 0
            start = key_bytes(parent_key)
        for engine_hash, key in zip(block_hashes, token_blocks(token_ids, block_size, parent=start), strict=True):
            if engine_hash in state.keys:
                continue  # announced again (a reused block): already held
            state.keys[engine_hash] = key
            state.held[key] = state.held.get(key, 0) + 1
            state.speculative.pop(key, None)  # held now: the events say when it goes
        state.stored += count
        if len(state.held) > self.max_blocks:
            log.warning("engine %s: more than %d blocks indexed; forgetting them", engine, self.max_blocks)
            self.purge(engine, "overflow")
        return count

    def removed(self, engine: str, block_hashes: Sequence[Hashable]) -> None:
        """A `BlockRemoved` event."""
        state = self.state(engine)
        for engine_hash in block_hashes:
            key = state.keys.pop(engine_hash, None)
            if key is None:
                continue
            state.removed += 1
            left = state.held.get(key, 0) - 1
            if left > 0:
                state.held[key] = left
            else:
                state.held.pop(key, None)
                state.speculative.pop(key, None)  # evicted: no longer there, whatever was routed

    def purge(self, engine: str, reason: str) -> None:
        """Forget everything about `engine`'s blocks (whether it is live is the caller's to say)."""
        state = self.state(engine)
        state.keys.clear()
        state.held.clear()
        state.speculative.clear()
        state.purges[reason] = state.purges.get(reason, 0) + 1

    # -- routing -------------------------------------------------------------------------------

    def speculate(self, engine: str, blocks: Sequence[BlockKey], now: float) -> None:
        """A request with these blocks was just sent to `engine`: count them as held for a moment."""
        speculative = self.state(engine).speculative
        expires = now + self.speculative_ttl
        for key in blocks:
            speculative[key] = expires
            speculative.move_to_end(key)
        while speculative:
            key, expiry = next(iter(speculative.items()))
            if expiry > now and len(speculative) <= self.max_blocks:
                break
            del speculative[key]

    def matched(self, engine: str, blocks: Sequence[BlockKey], now: float) -> int:
        """How many of the leading `blocks` `engine` holds (or was just sent)."""
        state = self.engines.get(engine)
        if state is None:
            return 0
        held, speculative = state.held, state.speculative
        count = 0
        for key in blocks:
            if key not in held:
                expiry = speculative.get(key)
                if expiry is None or expiry <= now:
                    break
            count += 1
        return count
