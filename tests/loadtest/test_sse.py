"""The SSE decoder and the meaning of chat-completion chunks, without I/O."""

import json

import pytest

from loadtest.chunks import ChunkKind, interpret
from loadtest.sse import SSEDecoder, SSEEvent, SSEProtocolError

STREAM = b': ping\n\ndata: {"a": 1}\n\nevent: update\nid: 7\ndata: line one\ndata: line two\n\ndata: [DONE]\n\n'
EXPECTED = [SSEEvent('{"a": 1}'), SSEEvent("line one\nline two", "update", "7"), SSEEvent("[DONE]", id="7")]


def feed_in_pieces(raw: bytes, size: int) -> list[SSEEvent]:
    decoder = SSEDecoder()
    events = []
    for start in range(0, len(raw), size):
        events += decoder.feed(raw[start : start + size])
    return events + decoder.close()


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_events_survive_any_split_of_the_bytes(size):
    assert feed_in_pieces(STREAM, size) == EXPECTED


@pytest.mark.parametrize("newline", [b"\r\n", b"\r"])
@pytest.mark.parametrize("size", [1, 5, 1000])
def test_crlf_and_cr_line_ends(newline, size):
    raw = STREAM.replace(b"\n", newline)
    assert feed_in_pieces(raw, size) == EXPECTED


def test_multibyte_utf8_split_across_reads_and_leading_bom():
    raw = "\ufeffdata: café ☕\n\n".encode()
    assert feed_in_pieces(raw, 1) == [SSEEvent("café ☕")]


def test_an_event_without_its_blank_line_is_dropped_at_the_end():
    decoder = SSEDecoder()
    assert decoder.feed(b"data: complete\n\ndata: partial\n") == [SSEEvent("complete")]
    assert decoder.close() == []


def test_trailing_cr_at_the_end_of_a_read_is_not_taken_for_a_blank_line():
    decoder = SSEDecoder()
    assert decoder.feed(b"data: a\r") == []
    assert decoder.feed(b"\ndata: b\r\n\r\n") == [SSEEvent("a\nb")]


def test_field_without_space_and_unknown_fields():
    assert feed_in_pieces(b"data:x\nretry: 5\nfoo: bar\n\n", 4) == [SSEEvent("x")]


def test_a_line_longer_than_the_limit_raises():
    decoder = SSEDecoder(max_line_chars=100)
    with pytest.raises(SSEProtocolError):
        decoder.feed(b"data: " + b"x" * 200)


def chunk(delta=None, finish=None, usage=None, choices=True):
    payload = {"object": "chat.completion.chunk", "choices": []}
    if choices:
        payload["choices"] = [{"index": 0, "delta": delta or {}, "finish_reason": finish}]
    if usage:
        payload["usage"] = usage
    return json.dumps(payload)


def test_chunk_kinds_as_vllm_sends_them():
    assert interpret("[DONE]").kind is ChunkKind.DONE
    role = interpret(chunk({"role": "assistant", "content": ""}))
    assert role.kind is ChunkKind.ROLE
    empty = interpret(chunk({"content": ""}))
    assert (empty.kind, empty.has_text) == (ChunkKind.TOKEN, False)
    text = interpret(chunk({"content": "hi"}))
    assert (text.kind, text.has_text, text.text) == (ChunkKind.TOKEN, True, "hi")
    usage = interpret(chunk(usage={"prompt_tokens": 5, "completion_tokens": 2}, choices=False))
    assert usage.kind is ChunkKind.USAGE and usage.usage["completion_tokens"] == 2
    last = interpret(chunk({"content": ""}, finish="length"))
    assert last.kind is ChunkKind.TOKEN and last.finish_reason == "length"


def test_reasoning_and_tool_calls_count_as_text():
    assert interpret(chunk({"reasoning_content": "hmm"})).has_text
    assert interpret(chunk({"tool_calls": [{"index": 0, "function": {"name": "f"}}]})).has_text
    assert interpret(chunk({"role": "assistant", "content": "Hi"})).kind is ChunkKind.TOKEN


def test_errors_inside_the_stream():
    error = interpret(json.dumps({"error": {"message": "boom", "code": 500}}))
    assert error.kind is ChunkKind.ERROR and "boom" in error.error
    assert interpret("{not json").kind is ChunkKind.ERROR
    assert interpret("[1, 2]").kind is ChunkKind.ERROR
