"""JSON in and out: orjson when it is installed (several times faster), the standard library if not.

`dumps_text` is for log lines: anything goes in (keys that are not strings, values JSON cannot
hold become their `str`, numbers too big for orjson), non-ASCII stays as it is, and the result is
one line of text. orjson writes floats in their shortest form (`5e-6` where the standard library
writes `5e-06`): the same number to any JSON reader.
"""

from __future__ import annotations

import json
from typing import Any


def _dumps_text_stdlib(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=str)


try:
    import orjson

    _TEXT_OPTIONS = orjson.OPT_NON_STR_KEYS

    def loads(data: bytes | str) -> Any:
        return orjson.loads(data)

    def dumps(value: Any) -> bytes:
        return orjson.dumps(value)

    def dumps_text(value: Any) -> str:
        """`value` as one line of JSON text (see the module doc)."""
        try:
            return orjson.dumps(value, default=str, option=_TEXT_OPTIONS).decode()
        except (TypeError, ValueError):  # an int beyond 64 bits, nesting too deep, a str subclass key...
            return _dumps_text_stdlib(value)

except ImportError:  # pragma: no cover - exercised only without orjson

    def loads(data: bytes | str) -> Any:
        return json.loads(data)

    def dumps(value: Any) -> bytes:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()

    def dumps_text(value: Any) -> str:
        """`value` as one line of JSON text (see the module doc)."""
        return _dumps_text_stdlib(value)
