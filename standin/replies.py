"""How a planned generation is answered: a stream of SSE events on the stand-in's exact schedule
(the first token `ttft_s` after the request arrived, then one every `itl_s`), or one JSON body after
the same generation time, in vLLM 0.32's shapes; with the `die_after_chunks`, `first_byte_delay_s`
and stall faults applied on the way.
"""

from __future__ import annotations

import asyncio
import json
import time

from standin.config import SYSTEM_FINGERPRINT, VOCABULARY
from standin.generation import Generation
from standin.wire import DONE, JSON_HEADERS, SSE_HEADERS, Died, Send, send_json


async def sleep_until(deadline: float) -> None:
    """Sleep until `deadline` on `time.perf_counter()`'s clock, never waking before it: the event
    loop's clock is read once per loop turn and its timers have a 1 ms resolution, so one sleep on
    a busy machine can end a little early (a token would then beat its schedule)."""
    while (remaining := deadline - time.perf_counter()) > 0:  # noqa: ASYNC110 - a deadline, no event to wait for
        await asyncio.sleep(remaining)


async def stream(send: Send, plan: Generation, arrived: float, model: str, timing: dict | None = None) -> None:
    """Send `plan` as an SSE stream on its schedule, recording token times into `timing`."""
    timing = timing if timing is not None else {}
    start = arrived
    if plan.first_byte_delay_s:
        await asyncio.sleep(plan.first_byte_delay_s)
        start = time.perf_counter()
    await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS + plan.headers})
    events = stream_events(plan, model)
    sent = 0
    first_token_at = start + plan.ttft_s
    token_index = 0
    for kind, data in events:
        if plan.die_after_chunks is not None and sent >= plan.die_after_chunks:
            raise Died()  # returning mid-response makes uvicorn close the connection abruptly
        if plan.stall_after_chunks is not None and sent == plan.stall_after_chunks and plan.stall_s:
            await asyncio.sleep(plan.stall_s)
            first_token_at += plan.stall_s
        if kind == "token":
            await sleep_until(first_token_at + token_index * plan.itl_s)
            token_index += 1
        await send({"type": "http.response.body", "body": data, "more_body": True})
        sent += 1
        if kind == "token":
            now = time.perf_counter()
            if token_index == 1:
                timing["first_token"] = now
                timing["ttft_s"] = now - arrived
            timing["last_token"] = now
            timing["tokens"] = token_index
    await send({"type": "http.response.body", "body": DONE, "more_body": False})


async def respond(send: Send, plan: Generation, arrived: float, model: str, state: dict) -> None:
    """Send `plan` as one JSON body once its generation time has passed (`state["done"]` before it)."""
    generation_s = plan.ttft_s + max(0, plan.n_tokens - 1) * plan.itl_s
    if plan.die_after_chunks is not None:
        await asyncio.sleep(min(generation_s, plan.ttft_s + plan.die_after_chunks * plan.itl_s))
        await send({"type": "http.response.start", "status": 200, "headers": JSON_HEADERS})
        raise Died()  # headers without a body, then uvicorn closes the connection
    if plan.stall_after_chunks is not None:
        generation_s += plan.stall_s
    delay = plan.first_byte_delay_s + generation_s - (time.perf_counter() - arrived)
    if delay > 0:
        await asyncio.sleep(delay)
    text = "".join(VOCABULARY[i % len(VOCABULARY)] for i in range(plan.n_tokens))
    usage = {
        "prompt_tokens": plan.prompt_tokens, "total_tokens": plan.prompt_tokens + plan.n_tokens,
        "completion_tokens": plan.n_tokens,
        "prompt_tokens_details": None if plan.cached_tokens is None else {"cached_tokens": plan.cached_tokens},
    }  # fmt: skip
    created = int(time.time())
    if plan.chat:
        choice = {
            "index": 0,
            "message": {
                "role": "assistant", "content": text, "refusal": None, "annotations": None,
                "audio": None, "function_call": None, "tool_calls": [], "reasoning": None,
            },
            "logprobs": None, "finish_reason": plan.finish_reason, "stop_reason": None, "token_ids": None,
        }  # fmt: skip
        result = {
            "id": f"chatcmpl-{plan.request_id}", "object": "chat.completion", "created": created,
            "model": model, "choices": [choice], "service_tier": None,
            "system_fingerprint": SYSTEM_FINGERPRINT, "usage": usage, "prompt_logprobs": None,
            "kv_transfer_params": None,
        }  # fmt: skip
    else:
        choice = {
            "index": 0, "text": text, "logprobs": None, "finish_reason": plan.finish_reason,
            "stop_reason": None, "token_ids": None, "prompt_logprobs": None, "prompt_token_ids": None,
        }  # fmt: skip
        result = {
            "id": f"cmpl-{plan.request_id}", "object": "text_completion", "created": created,
            "model": model, "choices": [choice], "service_tier": None,
            "system_fingerprint": SYSTEM_FINGERPRINT, "usage": usage, "kv_transfer_params": None,
        }  # fmt: skip
    state["done"] = True  # from here on a disconnect is the normal end of the exchange
    await send_json(send, 200, result, plan.headers)


def stream_events(plan: Generation, model: str) -> list[tuple[str, bytes]]:
    """Every SSE event of one stream, pre-encoded: ("role"|"token"|"usage", bytes)."""
    created = int(time.time())
    dumps = json.dumps
    # vLLM 0.32 stamps the fingerprint on the chunk that finishes a choice only without include_usage
    # (with it, on the usage chunk instead).
    stamp = "" if plan.include_usage else f',"system_fingerprint":"{SYSTEM_FINGERPRINT}"'
    if plan.chat:
        head = (
            f'data: {{"id":"chatcmpl-{plan.request_id}","object":"chat.completion.chunk",'
            f'"created":{created},"model":{dumps(model)},"choices":[{{"index":0,"delta":{{'
        ).encode()
        events = [(
            "role",
            head + b'"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],'
            b'"prompt_token_ids":null,"prompt_text":null}\n\n',
        )]  # fmt: skip
        middle = b'},"logprobs":null,"finish_reason":null,"token_ids":null}]}\n\n'
        last = (
            f'}},"logprobs":null,"finish_reason":"{plan.finish_reason}","stop_reason":null,'
            f'"token_ids":null}}]{stamp}}}\n\n'
        )
        for i in range(plan.n_tokens):
            token = dumps(VOCABULARY[i % len(VOCABULARY)]).encode()
            tail = middle if i < plan.n_tokens - 1 else last.encode()
            events.append(("token", head + b'"content":' + token + tail))
        object_ = "chat.completion.chunk"
        id_ = f"chatcmpl-{plan.request_id}"
    else:
        head = (
            f'data: {{"id":"cmpl-{plan.request_id}","object":"text_completion","created":{created},'
            f'"model":{dumps(model)},"choices":[{{"index":0,"text":'
        ).encode()
        middle = (
            b',"logprobs":null,"finish_reason":null,"stop_reason":null,"prompt_token_ids":null,"token_ids":null}]}\n\n'
        )
        last = (
            f',"logprobs":null,"finish_reason":"{plan.finish_reason}","stop_reason":null,'
            f'"prompt_token_ids":null,"token_ids":null}}]{stamp}}}\n\n'
        ).encode()
        events = []
        for i in range(plan.n_tokens):
            token = dumps(VOCABULARY[i % len(VOCABULARY)]).encode()
            events.append(("token", head + token + (middle if i < plan.n_tokens - 1 else last)))
        object_ = "text_completion"
        id_ = f"cmpl-{plan.request_id}"
    if plan.include_usage:
        usage = {
            "prompt_tokens": plan.prompt_tokens, "total_tokens": plan.prompt_tokens + plan.n_tokens,
            "completion_tokens": plan.n_tokens,
        }  # fmt: skip
        if plan.cached_tokens is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": plan.cached_tokens}
        chunk = {
            "id": id_, "object": object_, "created": created, "model": model, "choices": [],
            "usage": usage, "system_fingerprint": SYSTEM_FINGERPRINT,
        }  # fmt: skip
        events.append(("usage", b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"))
    return events
