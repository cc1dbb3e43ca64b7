"""Token usage for every stream, also when the client did not ask for it, with the client's stream unchanged.

vLLM reports a stream's usage only in a last chunk (`choices: []`, `usage`) that it sends when
the request asks for `stream_options.include_usage`. The gateway's token counters need it for
every stream, so for a streamed chat or completions request whose client did not ask
(`hide_usage_from_client`), the engine is asked anyway, and the relay (`HiddenUsage`) gives the
client the stream it would have had without asking. What vLLM 0.32 sends differs in two places
(seen on the real engine; vllm/entrypoints/openai/{chat_completion,completion}/serving.py):

    without include_usage                           with include_usage
    ...                                             ...
    data: {..."finish_reason":"length"...}],        data: {..."finish_reason":"length"...}]}
          "system_fingerprint":"vllm-0.32.0-..."}
                                                    data: {..."choices":[],"usage":{...},
                                                          "system_fingerprint":"vllm-0.32.0-..."}
    data: [DONE]                                    data: [DONE]

Neither form has `"usage": null` on the other chunks. So the relay drops the usage chunk and
stamps its `system_fingerprint` on each chunk that finished a choice, as vLLM would have (an
engine started with `--fingerprint-mode none` sends none: nothing is stamped). A chunk that
finishes a choice is held until the next read, which in a one-choice stream is the usage chunk
(vLLM sends it right after); with several choices (`n` > 1) a choice can finish before the
others, and the fingerprint last seen from that engine is stamped instead of waiting.

Per chunk this costs what `UsageScanner` costs plus one `bytes.find` (a finished choice); JSON
is parsed only for the usage chunk. An event split across two reads is forwarded once it is
complete. `continuous_usage_stats` (usage on every chunk) is turned off for such requests, as
vLLM ignores it without `include_usage`.
"""

from __future__ import annotations

from typing import Any

from server.gateway.http.sse import MAX_USAGE_BUFFER, USAGE_MARKER, usage_object_follows
from server.gateway.jsonio import dumps, loads
from server.gateway.request.request import GatewayRequest

_ASK = b'"stream_options":{"include_usage":true},'
_FINISHED = b'"finish_reason":"'  # a choice's last chunk: `"finish_reason":null` on the others
_FINGERPRINT = b'"system_fingerprint":'
_END = b"\n\n"
MAX_FINGERPRINTS = 4096  # engines remembered; beyond that the memory starts afresh


def hide_usage_from_client(request: GatewayRequest) -> bool:
    """Ask the engine for usage if the client of this stream did not; True if so (hide it from the client).

    A body without `stream_options` gets them spliced in after its opening brace (no
    re-serialisation: the body parsed as an object, so its first non-blank byte is `{`)."""
    if not (request.stream and request.endpoint.usage_option):
        return False
    if "stream_options" not in request.body:
        raw = request.raw
        start = raw.find(b"{") + 1
        request.raw = raw[:start] + _ASK + raw[start:]
        return True
    options = request.body["stream_options"]
    if options is None:  # `"stream_options": null`: re-serialised (a spliced key would be a duplicate)
        options = {}
    if not isinstance(options, dict) or options.get("include_usage") is True:
        return False
    request.replace_body(
        dict(request.body, stream_options=dict(options, include_usage=True, continuous_usage_stats=False))
    )
    return True


def _payload(event: bytes) -> Any:
    start = event.find(b"data:")
    if start == -1:
        return None
    try:
        return loads(event[start + 5 :])
    except ValueError:
        return None


def stamp(events: bytes, fingerprint: bytes | None) -> bytes:
    """`events` with `"system_fingerprint": fingerprint` on each event that finished a choice."""
    if fingerprint is None or events.find(_FINISHED) == -1:
        return events
    out = []
    for event in events.split(_END):
        if event.find(_FINISHED) != -1 and event.find(_FINGERPRINT) == -1 and (brace := event.rfind(b"}")) != -1:
            event = event[:brace] + b"," + _FINGERPRINT + fingerprint + event[brace:]
        out.append(event)
    return _END.join(out)


class HiddenUsage:
    """The relay's filter for a stream whose usage the client did not ask for (see the module doc).

    `feed(chunk)` returns the bytes to send the client now (maybe none); `finish()` the usage
    seen, after which `rest` holds what is still to be sent."""

    __slots__ = ("usage", "rest", "_tail", "_held", "_fingerprints", "_engine")

    def __init__(self, fingerprints: dict[str, bytes], engine: str) -> None:
        self.usage: dict[str, Any] | None = None
        self.rest = b""
        self._tail = b""  # an unfinished event
        self._held = b""  # events up to a finished choice, waiting for the fingerprint
        self._fingerprints = fingerprints  # engine id -> its last fingerprint (JSON), shared by requests
        self._engine = engine

    def feed(self, chunk: bytes) -> bytes:
        if (  # most chunks: whole events, nothing held, no usage, no finished choice: passed on as they are
            not self._tail
            and not self._held
            and chunk.endswith(_END)
            and chunk.find(USAGE_MARKER) == -1
            and chunk.find(_FINISHED) == -1
        ):
            return chunk
        if self._tail:
            chunk = self._tail + chunk
            self._tail = b""
        if not chunk.endswith(_END):
            cut = chunk.rfind(_END)
            cut = cut + 2 if cut != -1 else 0
            if len(chunk) - cut > MAX_USAGE_BUFFER:  # not SSE as vLLM sends it: pass it on as it is
                return self.take() + chunk
            self._tail = chunk[cut:]
            chunk = chunk[:cut]
            if not chunk:  # no whole event yet
                return b""
        found = False
        fingerprint = None
        if usage_object_follows(chunk) != -1:
            chunk, found, fingerprint = self._without_usage(chunk)
        if found:
            chunk = stamp(self._held + chunk, fingerprint)
            self._held = b""
            return chunk
        held = self._held
        if held:  # the next read came without the usage chunk (several choices): the fingerprint known
            held = stamp(held, self._fingerprints.get(self._engine))
            self._held = b""
        finished = chunk.find(_FINISHED)
        if finished != -1:  # hold from the event that finished a choice on
            start = chunk.rfind(_END, 0, finished)
            start = start + 2 if start != -1 else 0
            self._held = chunk[start:]
            return held + chunk[:start]
        return held + chunk if held else chunk

    def _without_usage(self, chunk: bytes) -> tuple[bytes, bool, bytes | None]:
        """`chunk` without its usage-only event; whether there was one; the fingerprint it carried."""
        kept = []
        found = False
        fingerprint = None
        for event in chunk.split(_END)[:-1]:  # `chunk` ends with an event's end
            if usage_object_follows(event) != -1:
                payload = _payload(event)
                usage = payload.get("usage") if isinstance(payload, dict) else None
                if isinstance(usage, dict) and payload.get("choices") == []:
                    self.usage = usage
                    found = True
                    value = payload.get("system_fingerprint")
                    if value is not None:
                        fingerprint = dumps(value)
                        if self._fingerprints.get(self._engine) != fingerprint:
                            if len(self._fingerprints) >= MAX_FINGERPRINTS:
                                self._fingerprints.clear()
                            self._fingerprints[self._engine] = fingerprint
                    continue
            kept.append(event + _END)
        return b"".join(kept), found, fingerprint

    def take(self) -> bytes:
        """What was held back (the stream ends early: it goes out before the error that ends it)."""
        held = stamp(self._held, self._fingerprints.get(self._engine)) + self._tail
        self._held = self._tail = b""
        return held

    def finish(self) -> dict[str, Any] | None:
        """The usage seen; `rest` is set to what is still to be sent (held events, an unterminated last one)."""
        tail, self._tail = self._tail, b""
        fingerprint = self._fingerprints.get(self._engine)
        if tail and usage_object_follows(tail) != -1:
            _, found, seen = self._without_usage(tail + _END)
            if found:
                tail, fingerprint = b"", seen
        self.rest = stamp(self._held, fingerprint) + tail
        self._held = b""
        return self.usage
