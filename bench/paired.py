"""Two servers' time to first token, paired: one client sends the same request to each in turn.

A shared machine moves a p50 time to first token by tenths of a millisecond from one window to the
next; two windows side by side still see different moments of it. Here one client asks one
server, then the other, then the other first (the order swaps every pair), one request at a time
on a keep-alive connection each: both halves of a pair see the same seconds of the machine, and
the median of the paired differences settles to a few microseconds (an A/A check of one gateway
against itself, pinned: -5..+4 us over three runs). `bench.request_work` and `bench.workers_bench`
report it; run the client on the engine's core, the two servers on another (`--pin` / the
workers bench's own pinning), or the scheduler places them anew each run.
"""

from __future__ import annotations

import json
import socket
import statistics
import time


def request_bytes(model: str, stream: bool, key: str | None = None, max_tokens: int = 8) -> bytes:
    """A chat request as raw HTTP/1.1 bytes (a bearer `key` if given: sent to both servers alike,
    one without tenants ignores it)."""
    body = json.dumps(
        {"model": model, "messages": [{"role": "user", "content": "hello there"}], "stream": stream,
         "max_tokens": max_tokens}
    ).encode()  # fmt: skip
    head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
    if key is not None:
        head += b"authorization: Bearer %s\r\n" % key.encode()
    return head + b"content-length: %d\r\n\r\n" % len(body) + body


class Client:
    """One keep-alive connection, raw bytes: the client's own work is the same for every server."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def ask(self, request: bytes, stream: bool) -> float:
        """Send one request, read its whole answer; the seconds to its first body byte (stream: the
        first `data:` event)."""
        started = time.perf_counter()
        self.sock.sendall(request)
        buf, first = b"", None
        while True:
            data = self.sock.recv(65536)
            if not data:
                raise SystemExit(f"the server closed the connection after {buf[:300]!r}")
            buf += data
            if first is None and ((b"data: {" in buf) if stream else (b"\r\n\r\n" in buf)):
                first = time.perf_counter() - started
            if stream and buf.endswith(b"0\r\n\r\n"):
                break
            if not stream and b"\r\n\r\n" in buf:
                head, _, body = buf.partition(b"\r\n\r\n")
                fields = (line.partition(b":") for line in head.split(b"\r\n"))
                length = next(int(v) for k, _, v in fields if k.lower() == b"content-length")
                if len(body) >= length:
                    break
        if not buf.startswith(b"HTTP/1.1 200"):
            raise SystemExit(f"the server answered {buf[:200]!r}")
        assert first is not None
        return first

    def close(self) -> None:
        self.sock.close()


def paired_ttft(ports: dict[str, int], requests: dict[str, bytes], stream: bool, n: int, warmup: int) -> dict:
    """The servers `ports["before"]` and `ports["after"]` in turn, one request each (`requests` by
    side), order swapped every pair: the median of the paired differences (after - before), with
    each side's quartiles, microseconds."""
    clients = {side: Client(port) for side, port in ports.items()}
    try:
        for _ in range(warmup):
            for side, client in clients.items():
                client.ask(requests[side], stream)
        times: dict[str, list[float]] = {side: [] for side in clients}
        for i in range(n):
            order = ("before", "after") if i % 2 == 0 else ("after", "before")
            for side in order:
                times[side].append(clients[side].ask(requests[side], stream) * 1e6)
    finally:
        for client in clients.values():
            client.close()
    diffs = sorted(a - b for a, b in zip(times["after"], times["before"]))

    def quartiles(values: list[float]) -> list[float]:
        return [round(q, 1) for q in statistics.quantiles(values, n=4)]

    return {
        "pairs": n,
        "median_diff_us": statistics.median(diffs),
        "diff_quartiles_us": quartiles(diffs),
        "before_us": quartiles(times["before"]),
        "after_us": quartiles(times["after"]),
    }
