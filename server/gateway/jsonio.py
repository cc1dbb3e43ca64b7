"""JSON in and out: orjson when it is installed (several times faster), the standard library if not."""

from __future__ import annotations

from typing import Any

try:
    import orjson

    def loads(data: bytes | str) -> Any:
        return orjson.loads(data)

    def dumps(value: Any) -> bytes:
        return orjson.dumps(value)

except ImportError:  # pragma: no cover - exercised only without orjson
    import json

    def loads(data: bytes | str) -> Any:
        return json.loads(data)

    def dumps(value: Any) -> bytes:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()
