"""vLLM's KV-cache events, received: one ZMQ subscriber per engine, feeding the precise index.

An engine started with `--kv-events-config` (a profile's `kv_events: true`) binds a ZMQ PUB
socket and sends every batch of KV-cache events as a multipart message `[topic, seq, payload]`:
`seq` an 8-byte big-endian counter from 0 at engine start, `payload` msgpack of
`[ts, [event, ...], data_parallel_rank]`, each event a map tagged by `type` (`BlockStored`,
`BlockRemoved`, `AllBlocksCleared`; vllm/distributed/kv_events.py), or, from an older vLLM, an
array `[type, field, ...]`. `decode` reads one message; `apply` writes its events to the index.
A chain's first block keeps its LoRA name and its `cache_salt` (from the event's `extra_keys`):
the index roots the chain in both (blocks.namespace), as the prompt's /tokenize blocks are.

The subscriber connects (vLLM binds), and ZMQ reconnects by itself. What it cannot see it purges:
- connected or reconnected: the engine may hold blocks sent before anyone listened, or be a new
  process; the index forgets it and is live from then on;
- disconnected: forgotten and not live, so routing falls back to the approximate index for it,
  as it does while the endpoint never answers at all;
- a sequence gap (events lost) or a sequence that starts over (the engine restarted between two
  messages): forgotten, still live;
- `AllBlocksCleared` (vLLM's /reset_prefix_cache): forgotten, still live.
There is no replay: vLLM's replay socket is off by default, and a purge is always safe.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from zmq.utils.monitor import parse_monitor_message

from server.gateway.replicas.blocks import namespace
from server.gateway.replicas.precise import PreciseIndex

log = logging.getLogger("gateway.kv_events")

# Field order of the array form (vLLM's msgspec structs, declaration order after the tag).
_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
)
_REMOVED_FIELDS = ("block_hashes", "medium")


class EventError(ValueError):
    """A message that is not a KV-event batch."""


@dataclass(frozen=True, slots=True)
class Stored:
    block_hashes: list[Any]
    parent: Any
    token_ids: list[int]
    block_size: int
    lora_name: str | None = None
    cache_salt: str | None = None  # of the first block, when the chain starts here (parent None)


@dataclass(frozen=True, slots=True)
class Removed:
    block_hashes: list[Any]


@dataclass(frozen=True, slots=True)
class Cleared:
    pass


Event = Stored | Removed | Cleared


def _hashable(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def first_block_salt(extra_keys: Any, lora_name: str | None) -> str | None:
    """The `cache_salt` a chain's first block was hashed with, from a `BlockStored`'s `extra_keys`.

    vLLM 0.32 publishes them untagged, one entry per block (vllm/v1/core/kv_cache_utils.py
    `to_event_extra_keys`): the LoRA name (when `lora_name` is set), `(mm_identifier, offset)`
    pairs, the salt (the first block only) and prompt-embeds digests (bytes), in that order. So
    the salt is the first string after the LoRA name."""
    if not isinstance(extra_keys, list) or not extra_keys or not isinstance(extra_keys[0], list | tuple):
        return None
    strings = [key for key in extra_keys[0] if isinstance(key, str)]
    if lora_name and strings and strings[0] == lora_name:
        strings = strings[1:]
    return strings[0] if strings else None


def _event(raw: Any) -> Event | None:
    if isinstance(raw, list) and raw and isinstance(raw[0], str):  # array form: [type, fields...]
        tag = raw[0]
        names = _STORED_FIELDS if tag == "BlockStored" else _REMOVED_FIELDS if tag == "BlockRemoved" else ()
        raw = {"type": tag, **dict(zip(names, raw[1:], strict=False))}
    if not isinstance(raw, dict):
        return None
    kind = raw.get("type")
    if kind == "BlockStored":
        hashes, tokens, size = raw.get("block_hashes"), raw.get("token_ids"), raw.get("block_size")
        if not isinstance(hashes, list) or not isinstance(tokens, list) or not isinstance(size, int):
            return None
        lora = raw.get("lora_name") if isinstance(raw.get("lora_name"), str) else None
        parent = _hashable(raw.get("parent_block_hash"))
        salt = first_block_salt(raw.get("extra_keys"), lora) if parent is None else None
        return Stored([_hashable(h) for h in hashes], parent, tokens, size, lora, salt)
    if kind == "BlockRemoved":
        hashes = raw.get("block_hashes")
        return Removed([_hashable(h) for h in hashes]) if isinstance(hashes, list) else None
    if kind == "AllBlocksCleared":
        return Cleared()
    return None  # a kind this gateway does not know: ignored


def decode(frames: Sequence[bytes]) -> tuple[int, list[Event]]:
    """(sequence number, events) of one multipart message; EventError if it is not one."""
    if len(frames) != 3 or len(frames[1]) != 8:
        raise EventError(f"expected [topic, 8-byte seq, payload], got {len(frames)} frames")
    seq = int.from_bytes(frames[1], "big", signed=True)
    try:
        batch = msgspec.msgpack.decode(frames[2])
    except msgspec.DecodeError as exc:
        raise EventError(f"payload is not msgpack: {exc}") from None
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
        raise EventError("payload is not [ts, events, dp_rank]")
    return seq, [event for raw in batch[1] if (event := _event(raw)) is not None]


def apply(index: PreciseIndex, engine: str, events: Sequence[Event]) -> None:
    """Write one batch's events for `engine` to the index, in order."""
    for event in events:
        if isinstance(event, Stored):
            index.stored(
                engine,
                block_hashes=event.block_hashes,
                parent=event.parent,
                token_ids=event.token_ids,
                block_size=event.block_size,
                namespace=namespace(event.lora_name or "", event.cache_salt or ""),
            )
        elif isinstance(event, Removed):
            index.removed(engine, event.block_hashes)
        else:
            index.purge(engine, "cleared")


class Sequencer:
    """Tells a gap or a restart from the sequence numbers of one engine's messages."""

    def __init__(self) -> None:
        self.last: int | None = None

    def check(self, seq: int) -> str | None:
        """None when `seq` follows the last one; else why the index must be purged."""
        last, self.last = self.last, seq
        if last is None or seq == last + 1:
            return None
        return "gap" if seq > last else "restart"


class KvEventSubscriber:
    """One background task per engine: subscribe to its KV events and keep the index current."""

    def __init__(
        self, index: PreciseIndex, endpoints: Mapping[str, str], *, context: zmq.asyncio.Context | None = None
    ) -> None:
        self.index = index
        self.endpoints = dict(endpoints)  # engine id -> tcp://host:port
        self._context = context
        self._owns_context = context is None
        self._tasks: list[asyncio.Task[None]] = []
        self.messages: dict[str, int] = dict.fromkeys(self.endpoints, 0)

    async def start(self) -> None:
        if self._tasks or not self.endpoints:
            return
        if self._context is None:
            self._context = zmq.asyncio.Context()
        self._tasks = [
            asyncio.create_task(self._run(engine, endpoint), name=f"kv events {engine}")
            for engine, endpoint in self.endpoints.items()
        ]

    async def aclose(self) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._owns_context and self._context is not None:
            self._context.term()
            self._context = None

    async def _run(self, engine: str, endpoint: str) -> None:
        assert self._context is not None
        socket = self._context.socket(zmq.SUB)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.RCVHWM, 100_000)
        socket.setsockopt(zmq.RECONNECT_IVL, 200)
        socket.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        socket.setsockopt(zmq.SUBSCRIBE, b"")
        monitor = socket.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        socket.connect(endpoint)
        sequencer = Sequencer()
        poller = zmq.asyncio.Poller()
        poller.register(socket, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        try:
            while True:
                for ready, _ in await poller.poll():
                    if ready is monitor:
                        message = parse_monitor_message(await monitor.recv_multipart())
                        self._on_monitor(engine, endpoint, dict(message), sequencer)
                    else:
                        self._on_message(engine, await socket.recv_multipart(), sequencer)
        finally:
            self.index.set_live(engine, False)
            socket.disable_monitor()
            monitor.close(linger=0)
            socket.close(linger=0)

    def _on_monitor(self, engine: str, endpoint: str, event: Mapping[str, Any], sequencer: Sequencer) -> None:
        if event["event"] == zmq.EVENT_CONNECTED:
            log.info("engine %s: KV events connected at %s", engine, endpoint)
            self.index.purge(engine, "connect")
            self.index.set_live(engine, True)
            sequencer.last = None
        elif event["event"] == zmq.EVENT_DISCONNECTED:
            log.warning("engine %s: KV events disconnected from %s; approximate routing for it", engine, endpoint)
            self.index.purge(engine, "disconnect")
            self.index.set_live(engine, False)

    def _on_message(self, engine: str, frames: list[bytes], sequencer: Sequencer) -> None:
        try:
            seq, events = decode(frames)
        except EventError as exc:
            log.warning("engine %s: unreadable KV event message: %s", engine, exc)
            return
        self.messages[engine] = self.messages.get(engine, 0) + 1
        previous = sequencer.last
        reason = sequencer.check(seq)
        if reason is not None:
            log.warning(
                "engine %s: KV event sequence %s (%d after %s); its blocks are forgotten", engine, reason, seq, previous
            )
            self.index.purge(engine, reason)
        self.index.set_live(engine, True)
        apply(self.index, engine, events)


PURGE_REASONS = ("connect", "disconnect", "gap", "restart", "cleared")


class KvEventsCollector:
    """`gateway_engine_kv_events_*`: per engine, whether its events are live, blocks indexed, purges.

    Every engine is reported, those that publish no events too (up 0: routing uses the approximate
    index for them), and every purge reason from 0, so rates and alerts have a series to read.
    """

    def __init__(self, index: PreciseIndex, models: Mapping[str, str]) -> None:
        self.index = index
        self.models = dict(models)  # engine id -> model

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        live = GaugeMetricFamily(
            "gateway_engine_kv_events_up",
            "1 while the engine's KV events are received (precise prefix routing).",
            labels=["model", "engine"],
        )
        blocks = GaugeMetricFamily(
            "gateway_engine_kv_events_blocks",
            "KV-cache blocks the engine holds, per its events.",
            labels=["model", "engine"],
        )
        purges = CounterMetricFamily(
            "gateway_engine_kv_events_purges",
            "Times the engine's indexed blocks were forgotten, by reason (connect, disconnect, gap, restart, cleared).",
            labels=["model", "engine", "reason"],
        )
        for engine, model in self.models.items():
            state = self.index.engines.get(engine)
            live.add_metric([model, engine], 1.0 if state is not None and state.live else 0.0)
            blocks.add_metric([model, engine], float(len(state.held)) if state is not None else 0.0)
            counts = state.purges if state is not None else {}
            for reason in (*PURGE_REASONS, *(r for r in counts if r not in PURGE_REASONS)):
                purges.add_metric([model, engine, reason], float(counts.get(reason, 0)))
        yield from (live, blocks, purges)
