"""Server-Sent Events decoding, byte by byte, as the WHATWG spec describes it.

Written here rather than taken from a library so that the load tester sees exactly what arrived
and when: the caller feeds the bytes of one network read and gets back the events that read
completed, all stamped with that read's arrival time.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass


class SSEProtocolError(ValueError):
    """The stream broke the SSE framing (for example a line longer than the allowed maximum)."""


@dataclass(frozen=True)
class SSEEvent:
    """One dispatched event: its `event:` type (default "message"), joined `data:` lines, `id:`."""

    data: str
    event: str = "message"
    id: str | None = None


class SSEDecoder:
    """Incremental SSE decoder: `feed(bytes)` returns the events completed by those bytes.

    Handles `\\n`, `\\r\\n` and `\\r` line ends (also split across reads), multi-line `data:`,
    comment lines (`: ping`), a leading BOM and UTF-8 split across reads. A line longer than
    `max_line_chars` raises SSEProtocolError instead of buffering without bound.
    """

    def __init__(self, *, max_line_chars: int = 4 * 1024 * 1024) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending = ""
        self._max_line_chars = max_line_chars
        self._data: list[str] = []
        self._event = ""
        self._id: str | None = None
        self._started = False

    def feed(self, raw: bytes) -> list[SSEEvent]:
        text = self._utf8.decode(raw)
        if not self._started and text:
            self._started = True
            text = text.removeprefix("\ufeff")
        return self._consume(self._pending + text)

    def close(self) -> list[SSEEvent]:
        """End of stream. Per the spec an event without its terminating blank line is dropped."""
        tail = self._pending + self._utf8.decode(b"", final=True)
        self._pending = ""
        # A held-back final "\r" was a complete line end after all; any other tail is a partial line.
        events = self._consume(tail + "\n") if tail.endswith("\r") else []
        self._data = []
        self._event = ""
        return events

    def _consume(self, text: str) -> list[SSEEvent]:
        if "\r" not in text:
            return self._consume_lf(text)
        events: list[SSEEvent] = []
        start = 0
        length = len(text)
        while start < length:
            newline = _next_line_end(text, start)
            if newline < 0:
                break
            if text[newline] == "\r" and newline + 1 == length:
                break  # a "\r" at the end of a read may be the first half of "\r\n"
            line = text[start:newline]
            start = newline + (2 if text.startswith("\r\n", newline) else 1)
            event = self._line(line)
            if event is not None:
                events.append(event)
        self._pending = text[start:]
        if len(self._pending) > self._max_line_chars:
            raise SSEProtocolError(f"SSE line longer than {self._max_line_chars} characters")
        return events

    def _line(self, line: str) -> SSEEvent | None:
        if not line:
            return self._dispatch()
        if line.startswith(":"):
            return None
        field, sep, value = line.partition(":")
        if sep and value.startswith(" "):
            value = value[1:]
        if field == "data":
            self._data.append(value)
        elif field == "event":
            self._event = value
        elif field == "id" and "\0" not in value:
            self._id = value
        return None

    def _dispatch(self) -> SSEEvent | None:
        if not self._data:
            self._event = ""
            return None
        event = SSEEvent(data="\n".join(self._data), event=self._event or "message", id=self._id)
        self._data = []
        self._event = ""
        return event

    def _consume_lf(self, text: str) -> list[SSEEvent]:
        """`_consume` for text whose only line ends are `\n` (what servers send): one split."""
        *lines, self._pending = text.split("\n")
        if len(self._pending) > self._max_line_chars:
            raise SSEProtocolError(f"SSE line longer than {self._max_line_chars} characters")
        events = []
        for line in lines:
            event = self._line(line)
            if event is not None:
                events.append(event)
        return events


def _next_line_end(text: str, start: int) -> int:
    cr = text.find("\r", start)
    lf = text.find("\n", start)
    if cr < 0:
        return lf
    if lf < 0:
        return cr
    return min(cr, lf)
