"""bench.paired: the paired TTFT between two servers, against two real uvicorn servers of which one
answers later by a known delay."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from bench.paired import paired_ttft, request_bytes
from tests.support import serve_in_thread


def sse_server(delay: float) -> Any:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        assert json.loads(body)["max_tokens"] == 1
        await asyncio.sleep(delay)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": b'data: {"x": 1}\n\ndata: [DONE]\n\n', "more_body": False})

    return app


def test_the_median_paired_difference_is_the_later_servers_delay():
    with serve_in_thread(sse_server(0.0)) as fast, serve_in_thread(sse_server(0.02)) as slow:
        ports = {"before": int(fast.rsplit(":", 1)[1]), "after": int(slow.rsplit(":", 1)[1])}
        request = request_bytes("m", True, key="sk-x", max_tokens=1)
        assert b"authorization: Bearer sk-x\r\n" in request
        result = paired_ttft(ports, dict.fromkeys(ports, request), True, n=20, warmup=2)
    assert result["pairs"] == 20
    assert 15_000 < result["median_diff_us"] < 200_000  # 20 ms later, give or take a busy machine
    assert result["before_us"][1] < result["after_us"][1]
