"""A request's origin and the start of its head, from a URL; and a whole head from headers.

For callers that start from a URL string (the load tester, the bench load generator). The
gateway parses its engines' URLs with httpx (server/gateway/proxy/transport.py) and builds its
heads itself, since it forwards raw header pairs.
"""

from __future__ import annotations

from collections.abc import Iterable
from urllib.parse import urlsplit

from http1.pool import Key


def request_start(url: str, method: str = "POST") -> tuple[Key, bytes]:
    """The origin of `url` (host, port, TLS) and the request line with its host header."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http:// or https:// URL: {url!r}")
    tls = parts.scheme == "https"
    port = parts.port or (443 if tls else 80)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    host = parts.hostname if parts.port is None else f"{parts.hostname}:{port}"
    return (parts.hostname, port, tls), f"{method} {path} HTTP/1.1\r\nhost: {host}\r\n".encode("latin-1")


def request_head(start: bytes, headers: Iterable[tuple[str, str]], body_length: int) -> bytes:
    """A whole request head: `start` (request_start's), the headers, a content-length, the blank line."""
    lines = "".join(f"{name}: {value}\r\n" for name, value in headers)
    return start + lines.encode("latin-1") + b"content-length: %d\r\n\r\n" % body_length
