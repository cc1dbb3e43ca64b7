"""Request logs: one JSON line per request on the `gateway.access` logger, and log set-up.

A request's line always carries the same keys (ACCESS_FIELDS, null when unknown), so log
pipelines can rely on them. Credentials never reach it: keys that name headers, keys or tokens
are dropped whatever the caller passes. The gateway never passes message content.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any, Literal

from server.gateway.jsonio import dumps_text

ACCESS_LOGGER = "gateway.access"
ACCESS_FIELDS = (
    "request_id",
    "model",
    "engine",
    "status",
    "stream",
    "ttft_s",
    "duration_s",
    "prompt_tokens",
    "completion_tokens",
    "trimmed_messages",
    "trimmed_tokens",
    "error",
    "routing",  # why the engine was chosen: policy, reason, matched blocks and scores per replica
)
# Written only when they apply (the gateway has tenants; the request passed the flow gate), after
# ACCESS_FIELDS and in this order; never credentials, so they skip the check of other extras.
OPTIONAL_FIELDS = ("tenant", "priority", "queued_s")
# Never logged, whatever the caller passes (compared lower-case, `-` read as `_`).
FORBIDDEN_FIELDS = frozenset(
    {
        "authorization",
        "proxy_authorization",
        "headers",
        "cookie",
        "set_cookie",
        "api_key",
        "x_api_key",
        "password",
        "secret",
        "token",
    }
)


def _clean(value: Any) -> Any:
    if isinstance(value, float):
        return round(value, 6)
    return value


def access_record(fields: dict[str, Any]) -> dict[str, Any]:
    """The dict logged for one request: every ACCESS_FIELDS key first, then allowed extras."""
    record: dict[str, Any] = {}
    get = fields.get
    for key in ACCESS_FIELDS:
        value = get(key)
        record[key] = round(value, 6) if isinstance(value, float) else value  # _clean, inlined
    keys = fields.keys()
    if keys <= _ACCESS_KEYS:
        return record
    if keys <= _KNOWN_KEYS:  # the gateway's own optional fields (a tenant's request): no other extras to check
        for key in OPTIONAL_FIELDS:
            value = get(key, record)  # (`record`: a default no caller can pass)
            if value is not record:
                record[key] = round(value, 6) if isinstance(value, float) else value  # _clean, inlined
        return record
    for key, value in fields.items():
        if key not in record and key.lower().replace("-", "_") not in FORBIDDEN_FIELDS:
            record[key] = _clean(value)
    return record


_ACCESS_KEYS = frozenset(ACCESS_FIELDS)
_KNOWN_KEYS = _ACCESS_KEYS | frozenset(OPTIONAL_FIELDS)


class AccessLine:
    """A request's log message: its JSON line, written only when a handler asks for the text.

    `JsonFormatter` puts the record's fields at the top level of its own line and never asks, so
    the line is serialised once; a text formatter (or a test's log capture) gets the JSON line."""

    __slots__ = ("record",)

    def __init__(self, record: dict[str, Any]) -> None:
        self.record = record

    def __str__(self) -> str:
        return dumps_text(self.record)


def log_request(**fields: Any) -> None:
    """Write one JSON line for a finished request on the `gateway.access` logger.

    When the line would only reach the handler `configure_logging` installed (JSON, no filters,
    no other handler on the way: the gateway's own set-up), it is written straight to that
    handler's stream, as that handler would write it, without a LogRecord and the logging
    machinery (a tenth of the relay's CPU per request); otherwise it goes through logging."""
    logger = _ACCESS
    if not logger.isEnabledFor(logging.INFO):
        return
    handler = _sole_json_handler(logger)
    if handler is None:
        record = access_record(fields)
        logger.info(AccessLine(record), extra={"access": record})
        return
    now = time.time()
    line = dumps_text({**_line_head(now, (now - int(now)) * 1000, "info", ACCESS_LOGGER), **access_record(fields)})
    handler.acquire()
    try:
        stream = handler.stream
        stream.write(line + handler.terminator)
        if stream and hasattr(stream, "flush"):  # as StreamHandler.flush does (its lock is held already)
            stream.flush()
    except Exception:  # noqa: BLE001 - as logging does: a failed log write must not fail the request
        handler.handleError(logging.makeLogRecord({"msg": line}))
    finally:
        handler.release()


_ACCESS = logging.getLogger(ACCESS_LOGGER)


def _sole_json_handler(logger: logging.Logger) -> logging.StreamHandler[Any] | None:
    """The handler of `configure_logging` (JSON) if it is the only one an INFO line of `logger` reaches."""
    found: logging.StreamHandler[Any] | None = None
    current: logging.Logger | None = logger
    while current is not None:
        if current.filters or current.disabled:
            return None
        for handler in current.handlers:
            if (
                found is not None
                or not getattr(handler, _HANDLER_MARK, False)
                or not isinstance(handler.formatter, JsonFormatter)
                or handler.filters
                or handler.level > logging.INFO
            ):
                return None
            found = handler  # type: ignore[assignment]
        if not current.propagate:
            break
        current = current.parent
    return found


_second: tuple[int, str] = (-1, "")  # the last second formatted, and its text (one tuple: thread-safe)


def utc_timestamp(created: float, msecs: float) -> str:
    """`2026-11-30T15:09:35.123Z` for a record's time; the part up to the second is formatted once a second."""
    global _second
    second = int(created)
    cached = _second
    if cached[0] != second:
        cached = _second = (second, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second)))
    return f"{cached[1]}.{int(msecs):03d}Z"


def _line_head(created: float, msecs: float, level: str, logger: str) -> dict[str, Any]:
    """The keys every JSON log line starts with (JsonFormatter's, and log_request's direct line)."""
    return {"ts": utc_timestamp(created, msecs), "level": level, "logger": logger}


class JsonFormatter(logging.Formatter):
    """Every log record as one JSON object per line; access records keep their fields at top level."""

    def format(self, record: logging.LogRecord) -> str:
        out = _line_head(record.created, record.msecs, record.levelname.lower(), record.name)
        access = getattr(record, "access", None)
        if isinstance(access, dict):
            out.update(access)
        else:
            out["msg"] = record.getMessage()
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return dumps_text(out)


_HANDLER_MARK = "_gateway_handler"


def configure_logging(fmt: Literal["json", "text"] = "json", level: int = logging.INFO) -> None:
    """Send the process's logs to stderr as JSON lines or plain text. Idempotent."""
    if fmt not in ("json", "text"):
        raise ValueError(f"log format must be 'json' or 'text', not {fmt!r}")
    # No format here uses the caller's file and line, thread or process names: do not collect them
    # for every record (the logging HOWTO's "Optimization"; the caller lookup alone walked the stack
    # for every access line).
    logging._srcfile = None
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    root = logging.getLogger()
    for handler in [h for h in root.handlers if getattr(h, _HANDLER_MARK, False)]:
        root.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    setattr(handler, _HANDLER_MARK, True)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    root.addHandler(handler)
    root.setLevel(level)
