"""The cheap looks into streamed bytes: first token detection and usage, however reads split them."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from server.gateway.http.sse import UsageScanner, ends_with_done, has_token, scan_for_token, usage_from_body


def event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


ROLE = event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
TOKEN = event({"choices": [{"index": 0, "delta": {"content": " hi"}}]})
USAGE = {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15}
LAST = event({"choices": [], "usage": USAGE})


@pytest.mark.parametrize(
    ("chunk", "expected"),
    [
        (ROLE, False),
        (TOKEN, True),
        (ROLE + TOKEN, True),
        (b'data: {"choices":[{"delta":{"content": "x"}}]}\n\n', True),  # a space after the colon
        (b'data: {"choices":[{"delta":{"content":null}}]}\n\n', False),
        (b'data: {"choices":[{"delta":{"reasoning_content":"hmm"}}]}\n\n', True),
        (b'data: {"choices":[{"text":"","index":0}]}\n\n', False),
        (b'data: {"choices":[{"text":" word","index":0}]}\n\n', True),
        (b'data: {"choices":[{"delta":{"tool_calls":[{"index":0,"id":"c1"}]}}]}\n\n', True),
        (b'data: {"choices":[{"delta":{"tool_calls":[]}}]}\n\n', False),
        (LAST, False),
        (b"data: [DONE]\n\n", False),
        (b'data: {"choices":[{"delta":{"content":"', False),  # cut where the string starts
        (b'data: {"choices":[{"delta":{"content":"x', True),
    ],
)
def test_has_token(chunk, expected):
    assert has_token(chunk) is expected


PIECES = [
    b'data: {"choices":[{"index":0,"delta":{', b'"role":"assistant",', b'"content":""', b'"content":"x"',
    b'"content": "y"', b'"content": ""', b'"content":null', b'"reasoning_content":""', b'"reasoning_content":"r"',
    b'"text":""', b'"text":"w"', b'"text": "w"', b'"tool_calls":[]', b'"tool_calls":[{"index":0}]',
    b'"tool_calls": [{"index":0}]', b'"usage":{"prompt_tokens":1}', b"}}]}\n\n", b"data: [DONE]\n\n", b",", b" ",
]  # fmt: skip


@given(st.lists(st.sampled_from(PIECES), max_size=10), st.integers(0, 400))
def test_the_shortcuts_agree_with_the_full_scan(pieces, cut):
    chunk = b"".join(pieces)
    for part in (chunk, chunk[:cut], chunk[cut:]):  # reads may split an event anywhere
        assert has_token(part) is scan_for_token(part)


def test_usage_from_the_final_chunk():
    scanner = UsageScanner()
    for chunk in (ROLE, TOKEN, TOKEN, LAST, b"data: [DONE]\n\n"):
        scanner.feed(chunk)
    assert scanner.finish() == USAGE


def test_null_usage_is_no_usage():
    scanner = UsageScanner()
    scanner.feed(event({"choices": [{"delta": {"content": "x"}}], "usage": None}))
    assert scanner.finish() is None


@given(st.lists(st.integers(1, 400), max_size=12))
def test_usage_is_found_however_the_stream_is_split(cuts):
    stream = ROLE + TOKEN + TOKEN + LAST + b"data: [DONE]\n\n"
    points = sorted({c % len(stream) for c in cuts} | {0, len(stream)})
    scanner = UsageScanner()
    for start, end in zip(points, points[1:], strict=False):
        scanner.feed(stream[start:end])
    assert scanner.finish() == USAGE


def test_continuous_usage_keeps_the_last_one():
    scanner = UsageScanner()
    for n in (1, 2, 3):
        scanner.feed(event({"choices": [{"delta": {"content": "x"}}], "usage": {"completion_tokens": n}}))
    assert scanner.finish() == {"completion_tokens": 3}


def test_usage_from_a_whole_body():
    body = json.dumps({"choices": [], "usage": USAGE}).encode()
    assert usage_from_body(body) == USAGE
    assert usage_from_body(b'{"usage": null}') is None
    assert usage_from_body(b"not json") is None


def test_ends_with_done():
    assert ends_with_done(TOKEN + b"data: [DONE]\n\n")
    assert not ends_with_done(TOKEN)


def test_only_the_last_usage_event_is_parsed_and_one_split_across_reads_still_counts():
    scanner = UsageScanner()
    scanner.feed(event({"choices": [{"delta": {"content": "x"}}], "usage": {"completion_tokens": 1}}))
    last = event({"choices": [], "usage": USAGE})
    scanner.feed(TOKEN + last[:30])
    assert scanner.usage is None  # nothing parsed while the stream runs
    scanner.feed(last[30:] + b"data: [DONE]\n\n")
    assert scanner.finish() == USAGE
