"""Request ids: the client's `x-request-id` when it sends a sane one, else a new one.

The router gives every request its id; the proxy forwards it to the engine and logs it, and
every response carries it back. A new id is 128 random bits in hex (as `uuid4().hex` looks) from
`random`'s generator, which is seeded from the OS at start and again in every forked worker:
ids need to be unique, not secret, and this costs no system call per request.
"""

from __future__ import annotations

import random
import re

REQUEST_ID_HEADER = b"x-request-id"
_random_bits = random.getrandbits
_SANE_ID = re.compile(rb"[\x21-\x7e]{1,128}")


def request_id_from(headers: list[tuple[bytes, bytes]]) -> str:
    for name, value in headers:
        if name == REQUEST_ID_HEADER:
            if _SANE_ID.fullmatch(value):
                return value.decode("ascii")
            break
    return f"{_random_bits(128):032x}"
