"""The record of one request: what was asked, when it left, what came back and when.

One record is one line of `requests.jsonl`. Times ending in `_s` are seconds; `scheduled_s` and
`sent_s` are measured from the start of the run, every other time from `sent_s` (the moment
just before the request was written to the connection, `time.perf_counter()`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

# Error kinds, one per way a request can fail (README "Load testing").
HTTP = "http"  # the server answered with a status other than 200
STREAM_ERROR = "stream_error"  # a `data: {"error": ...}` event inside a 200 stream
TIMEOUT = "timeout"  # no complete answer within --timeout
TRUNCATED = "truncated"  # the stream ended (or the connection broke) before `data: [DONE]`
CONNECTION = "connection"  # no HTTP response at all (refused, reset before the status line)
NO_TOKENS = "no_tokens"  # a complete stream without a single token chunk
ERROR_KINDS = (HTTP, STREAM_ERROR, TIMEOUT, TRUNCATED, CONNECTION, NO_TOKENS)


@dataclass
class RequestRecord:
    """Everything measured about one request (see the module docstring for time origins)."""

    request_id: str
    target: str = "A"
    run: str = ""
    phase: str = "measure"  # "warmup" records are excluded from the metrics
    session_id: str | None = None
    turn: int = 0
    prompt_messages: int = 0
    prompt_chars: int = 0
    max_tokens: int | None = None
    scheduled_s: float = 0.0
    sent_s: float = 0.0
    status: int | None = None
    response_headers_s: float | None = None  # status line and headers received
    first_chunk_s: float | None = None  # first chunk with choices (vLLM's TTFT point)
    ttft_s: float | None = None  # first token chunk with text (our TTFT)
    chunk_s: list[float] = field(default_factory=list)  # every token chunk from the TTFT one on
    e2e_s: float | None = None  # last token chunk
    closed_s: float | None = None  # the stream closed (after usage and [DONE])
    prompt_tokens: int | None = None
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, when reported
    completion_tokens: int | None = None
    tokens_from_usage: bool = False
    finish_reason: str | None = None
    output_chars: int = 0
    done: bool = False  # saw `data: [DONE]`
    error_kind: str | None = None
    error: str | None = None
    engine: dict | None = None  # engine /metrics sampled while the request was in flight
    headers: dict | None = None  # response headers asked for with --record-header

    @property
    def ok(self) -> bool:
        return self.error_kind is None

    @property
    def lateness_s(self) -> float:
        """How late the request left against its schedule (client saturation, ceilings)."""
        return max(0.0, self.sent_s - self.scheduled_s)

    @property
    def end_s(self) -> float:
        """Run-relative time the request was over (its stream closed or it failed)."""
        for value in (self.closed_s, self.e2e_s, self.response_headers_s):
            if value is not None:
                return self.sent_s + value
        return self.sent_s

    def to_json(self) -> dict:
        data = dataclasses.asdict(self)
        data["lateness_s"] = self.lateness_s
        return data

    @classmethod
    def from_json(cls, data: dict) -> RequestRecord:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})
