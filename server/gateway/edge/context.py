"""Request ids: the client's `x-request-id` when it sends a sane one, else a new one.

The router gives every request its id; the proxy forwards it to the engine and logs it, and
every response carries it back.
"""

from __future__ import annotations

import re
import uuid

REQUEST_ID_HEADER = b"x-request-id"
_SANE_ID = re.compile(rb"[\x21-\x7e]{1,128}")


def request_id_from(headers: list[tuple[bytes, bytes]]) -> str:
    for name, value in headers:
        if name == REQUEST_ID_HEADER:
            if _SANE_ID.fullmatch(value):
                return value.decode("ascii")
            break
    return uuid.uuid4().hex
