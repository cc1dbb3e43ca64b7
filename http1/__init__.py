"""One HTTP/1.1 client for the gateway's transport to engines, the load tester and the bench load generator.

asyncio and httptools (the C parser uvicorn uses), nothing else: keep-alive connections
(connection.py) with content-length, chunked and close-delimited bodies, read buffered or
spliced into a sink chunk by chunk, reads stamped on arrival when asked, flow control both
ways; a pool per origin with a bound and a retry for connections that went stale (pool.py);
errors of its own (exceptions.py), which each user translates in one place. It imports nothing
of `server` or `loadtest` (an import-linter contract says so).
"""

from http1.connection import PAUSE_ABOVE, Connection, ends_at_close
from http1.exceptions import ConnectError, ConnectTimeout, Http1Error, ProtocolError, ReadTimeout
from http1.pool import Key, Origin, Pool
from http1.request import request_head, request_start

__all__ = [
    "PAUSE_ABOVE",
    "ConnectError",
    "ConnectTimeout",
    "Connection",
    "Http1Error",
    "Key",
    "Origin",
    "Pool",
    "ProtocolError",
    "ReadTimeout",
    "ends_at_close",
    "request_head",
    "request_start",
]
