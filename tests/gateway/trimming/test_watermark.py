"""Watermark trimming: its invariants, a cut that stays put, and the same prompt from a fresh process.

The pure function is checked against a brute-force replay written out plainly here, over random
conversations with tool calls; stability is checked by appending one message; determinism by
running the step (counter included) in a fresh Python process and comparing bytes.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server.gateway.trimming.core import leading_instructions, trim_messages
from server.gateway.trimming.watermark import low_mark_tokens, watermark_trim
from tests.gateway.trimming.conversations import conversations, weight
from tests.gateway.trimming.test_core import _pairs_intact


def _valid(messages: list[dict], head: int, cut: int) -> bool:
    kept = messages[:head] + messages[cut:]
    return messages[cut]["role"] != "tool" and _pairs_intact(kept, messages)


def _reference_cut(messages: list[dict], high: int, low: int, overhead: int) -> int:
    """The watermark replay, brute force: every request point, every candidate cut recounted."""
    head = leading_instructions(messages)
    n = len(messages)
    valid = [c for c in range(head + 1, n) if _valid(messages, head, c)]

    def size(cut: int, k: int) -> int:
        return overhead + sum(map(weight, messages[:head])) + sum(map(weight, messages[cut:k]))

    cut = head
    for k in range(head + 1, n + 1):
        if k < n and messages[k - 1]["role"] == "assistant":
            continue
        if size(cut, k) <= high:
            continue
        candidates = [c for c in valid if cut < c <= k - 1]
        if not candidates:
            continue
        users = [c for c in candidates if messages[c]["role"] == "user"]
        if [c for c in users if size(c, k) <= low]:
            cut = [c for c in users if size(c, k) <= low][0]
        elif [c for c in users if size(c, k) <= high]:
            cut = [c for c in users if size(c, k) <= high][-1]
        elif [c for c in candidates if size(c, k) <= low]:
            cut = [c for c in candidates if size(c, k) <= low][0]
        else:
            cut = candidates[-1]
    return cut


@settings(max_examples=400, deadline=None)
@given(
    conversations(),
    st.integers(min_value=0, max_value=600),
    st.floats(min_value=0.05, max_value=1.0),
    st.integers(min_value=0, max_value=12),
)
def test_invariants_hold_for_random_conversations(messages, high, fraction, overhead):
    low = low_mark_tokens(high, fraction)
    result = watermark_trim(messages, high, low, weight, overhead=overhead)
    head = leading_instructions(messages)
    total = sum(map(weight, messages)) + overhead
    window = trim_messages(messages, high, weight, overhead=overhead)
    # It fits exactly when the window fits: the same smallest prompt, the same refusal.
    assert result.fits == window.fits
    if not result.fits:
        assert result.messages == messages and result.dropped_messages == 0
        assert result.required_tokens == window.required_tokens > high
        return
    kept = result.messages
    assert sum(map(weight, kept)) + overhead == result.kept_tokens <= high
    assert result.kept_tokens + result.dropped_tokens == total
    assert len(kept) + result.dropped_messages == len(messages)
    # Instructions first, then a suffix of the conversation ending with the newest message.
    assert kept[:head] == messages[:head]
    assert kept[-1] is messages[-1]
    rest = kept[head:]
    assert rest == messages[len(messages) - len(rest) :]
    assert _pairs_intact(kept, messages)
    if result.trimmed:
        assert rest[0]["role"] != "tool"
    # Starting on a user message, it never keeps more than the window (whose cut is the first
    # user message that fits).
    if result.trimmed and rest[0]["role"] == "user":
        assert len(kept) <= len(window.messages)
    # The cut the plain replay arrives at (which starts on a user message whenever one fits).
    assert len(messages) - len(rest) == _reference_cut(messages, high, low, overhead)


@settings(max_examples=400, deadline=None)
@given(
    conversations(),
    st.data(),
    st.integers(min_value=20, max_value=600),
    st.floats(min_value=0.05, max_value=1.0),
    st.integers(min_value=0, max_value=12),
)
def test_appending_a_message_under_the_high_mark_never_moves_the_cut(longer, data, high, fraction, overhead):
    # `before` is a request (it does not end on an assistant message); `new` is the next message.
    splits = [i for i in range(1, len(longer)) if longer[i - 1]["role"] != "assistant"]
    if not splits:
        return
    split = data.draw(st.sampled_from(splits))
    before, new = longer[:split], longer[split]
    low = low_mark_tokens(high, fraction)
    first = watermark_trim(before, high, low, weight, overhead=overhead)
    if not first.fits or first.kept_tokens + weight(new) > high:
        return
    second = watermark_trim([*before, new], high, low, weight, overhead=overhead)
    assert second.messages == [*first.messages, new]
    assert second.kept_tokens == first.kept_tokens + weight(new)


def test_a_cut_goes_down_to_the_low_mark_then_the_conversation_only_grows():
    system = {"role": "system", "content": "s" * 7}  # weight 10
    history: list[dict] = [system]
    prompts, windows = [], []
    for turn in range(30):  # each turn: a question (20 tokens) sent, then its answer (20) appended
        history.append({"role": "user", "content": f"q{turn:02d}" + "w" * 14})
        result = watermark_trim(history, 200, 100, weight, overhead=0)
        assert result.fits and result.kept_tokens <= 200
        prompts.append(result.messages)
        windows.append(trim_messages(history, 200, weight).messages)
        history.append({"role": "assistant", "content": f"a{turn:02d}" + "w" * 14})
    cuts = [t for t in range(1, 30) if prompts[t][: len(prompts[t - 1])] != prompts[t - 1]]
    # Between cuts each prompt is the previous one plus the answer and the new question.
    for t in range(1, 30):
        if t not in cuts:
            assert prompts[t] == [*prompts[t - 1], history[2 * t], history[2 * t + 1]]
    # A cut leaves at most the low mark and starts on a user message, so the next turns fit.
    for t in cuts:
        assert sum(map(weight, prompts[t])) <= 100 and prompts[t][1]["role"] == "user"
    assert 0 < len(cuts) <= 30 // 2
    # The window, by contrast, moves its cut on every turn once over budget.
    moved = [t for t in range(1, 30) if windows[t][: len(windows[t - 1])] != windows[t - 1]]
    assert moved == list(range(moved[0], 30)) and len(moved) > 2 * len(cuts)


def test_a_low_mark_below_the_instructions_keeps_the_newest_turn_only():
    messages = [{"role": "system", "content": "s" * 97}]  # weight 100
    for turn in range(10):
        messages.append({"role": "user" if turn % 2 == 0 else "assistant", "content": "w" * 17})
    result = watermark_trim(messages, 180, 50, weight)
    assert result.fits
    assert result.messages[0] is messages[0] and result.messages[1]["role"] == "user"
    assert result.kept_tokens <= 180


_FRESH = textwrap.dedent("""
    import asyncio, json, sys
    from server.config import TrimmingConfig
    from server.gateway.request.endpoints import BY_NAME
    from server.gateway.request.request import parse_request
    from server.gateway.errors import GatewayError
    from server.gateway.trimming.step import HistoryTrimming
    from tests.gateway.trimming.test_watermark import Target

    async def main():
        out = []
        for raw in json.load(sys.stdin):
            target = Target()
            async def lookup(model):
                return target
            request = parse_request(raw.encode(), BY_NAME["chat"])
            try:
                await HistoryTrimming(lookup=lookup)(request)
            except GatewayError as exc:  # a turn that cannot fit at all: refused alike
                out.append("refused: " + exc.message)
                continue
            out.append(request.raw.decode())
        json.dump(out, sys.stdout)

    asyncio.run(main())
""")


class Target:
    """A model with a 400-token context whose template costs 3 + len(content) per message."""

    max_model_len = 400

    def __init__(self) -> None:
        from server.config import TrimmingConfig

        self.trimming = TrimmingConfig(mode="auto", default_max_tokens=50, low_mark=0.6)

    async def tokenize(self, messages: list[dict], add_generation_prompt: bool) -> int:
        return 1 + sum(weight(m) for m in messages) + (2 if add_generation_prompt else 0)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(conversations(), min_size=1, max_size=3))
async def test_the_same_conversation_gives_the_same_prompt_from_a_fresh_process(histories):
    """A gateway that saw the conversation grow turn by turn (its counter warm) and a fresh
    process that sees only the last turn send the same bytes, on every turn."""
    from server.gateway.errors import GatewayError
    from server.gateway.request.endpoints import BY_NAME
    from server.gateway.request.request import parse_request
    from server.gateway.trimming.step import HistoryTrimming

    target = Target()

    async def lookup(model):
        return target

    warm = HistoryTrimming(lookup=lookup)
    bodies, sent = [], []
    for history in histories:
        for end in range(1, len(history) + 1):
            raw = json.dumps({"model": "m", "messages": history[:end]})
            request = parse_request(raw.encode(), BY_NAME["chat"])
            bodies.append(raw)
            try:
                await warm(request)
            except GatewayError as exc:  # even the system prompt and the newest turn do not fit
                sent.append("refused: " + exc.message)
                continue
            sent.append(request.raw.decode())
    fresh = subprocess.run(
        [sys.executable, "-c", _FRESH],
        input=json.dumps(bodies),
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert json.loads(fresh.stdout) == sent
