"""Request logs: one JSON line per request on the `gateway.access` logger, and log set-up.

A request's line always carries the same keys (ACCESS_FIELDS, null when unknown), so log
pipelines can rely on them. Credentials never reach it: keys that name headers, keys or tokens
are dropped whatever the caller passes. The gateway never passes message content.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any, Literal

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
    record = {key: _clean(fields.get(key)) for key in ACCESS_FIELDS}
    for key, value in fields.items():
        if key not in record and key.lower().replace("-", "_") not in FORBIDDEN_FIELDS:
            record[key] = _clean(value)
    return record


def log_request(**fields: Any) -> None:
    """Write one JSON line for a finished request on the `gateway.access` logger."""
    logger = logging.getLogger(ACCESS_LOGGER)
    if not logger.isEnabledFor(logging.INFO):
        return
    record = access_record(fields)
    line = json.dumps(record, ensure_ascii=False, separators=(",", ":"), default=str)
    logger.info(line, extra={"access": record})


class JsonFormatter(logging.Formatter):
    """Every log record as one JSON object per line; access records keep their fields at top level."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
        }
        access = getattr(record, "access", None)
        if isinstance(access, dict):
            out.update(access)
        else:
            out["msg"] = record.getMessage()
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False, separators=(",", ":"), default=str)


_HANDLER_MARK = "_gateway_handler"


def configure_logging(fmt: Literal["json", "text"] = "json", level: int = logging.INFO) -> None:
    """Send the process's logs to stderr as JSON lines or plain text. Idempotent."""
    if fmt not in ("json", "text"):
        raise ValueError(f"log format must be 'json' or 'text', not {fmt!r}")
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
