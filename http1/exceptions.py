"""What can go wrong below HTTP, for every user of http1; each translates these in one place.

    Http1Error
     ├── ConnectError          no connection: refused, unreachable, DNS, TLS handshake
     │    └── ConnectTimeout   none within the connect timeout
     ├── ReadTimeout           nothing arrived within the read timeout
     └── ProtocolError         the connection broke before the answer ended, or the answer
                               is not valid HTTP/1.1 (bad framing, a head over its limit, an
                               answer nobody asked for)

The gateway maps them to httpx's exceptions (server/gateway/proxy/transport.py), the load
tester keeps them as its own (loadtest/transport.py), the bench load generator counts them.
"""

from __future__ import annotations


class Http1Error(Exception):
    """A request failed below HTTP: no connection, a timeout, or a broken or invalid answer."""


class ConnectError(Http1Error):
    """No connection to the server (refused, unreachable, DNS, TLS handshake)."""


class ConnectTimeout(ConnectError):
    """No connection to the server within the connect timeout."""


class ReadTimeout(Http1Error):
    """The server sent nothing within the read timeout."""


class ProtocolError(Http1Error):
    """The connection broke before the answer ended, or what came back is not valid HTTP/1.1."""
