"""Watermark trimming: cut well below the budget once, then only append, so the prefix cache keeps hitting.

vLLM's prefix cache reuses a prompt's leading blocks (chained block hashes from the start). The
moving window (`core.trim_messages`: the longest suffix that fits) moves its cut on every turn
once a conversation is over budget, so every prompt differs from the previous one right after
the instructions and the whole history is prefilled again. Watermarks keep the cut still:

- while the prompt fits the budget (the high mark), nothing changes: the conversation grows at
  its end and the engine finds every earlier block in its cache;
- when it passes the high mark, whole turns after the instructions are dropped until the prompt
  fits the low mark (a fraction of the budget), or as near to it as the instructions and the
  newest turn allow; that cut then stays until the high mark is passed again.

The gateway keeps no state per conversation, so the cut must be a pure function of the
conversation: `watermark_trim` replays its growth from the first message, one message at a
time, with the same rule, from per-message token counts the counter has cached. Two gateway
replicas, a retry and a restarted gateway compute the same cut, byte for byte; appending a
message that keeps the prompt under the high mark never moves it. The replay costs a few
operations per message (prefix sums and a binary search per cut), no tokenizer call.

Every rule of `core.trim_messages` holds: the instructions and the newest message are kept, a
tool call stays with its results, the kept turns start on a user message where such a cut
exists, and when even the smallest prompt does not fit, the result says so with both numbers.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Sequence
from itertools import accumulate

from server.gateway.trimming.core import Message, TrimResult, leading_instructions, valid_cuts


def low_mark_tokens(high: int, fraction: float) -> int:
    """The low mark for a high mark: `fraction` of it, rounded down."""
    return int(high * fraction)


def watermark_trim(
    messages: Sequence[Message],
    high: int,
    low: int,
    count: Callable[[Message], int],
    *,
    overhead: int = 0,
) -> TrimResult:
    """Keep the instructions and the conversation from the cut the watermark replay arrives at.

    `count(message)` is the number of tokens the message adds to the rendered prompt (>= 0);
    `overhead` is added once; `high` is the budget and `low` (<= `high`) the low mark.
    """
    messages = list(messages)
    counts = [count(message) for message in messages]
    total = sum(counts) + overhead
    if total <= high:  # no prefix of the conversation ever passed the high mark
        return TrimResult(messages=messages, dropped_messages=0, dropped_tokens=0, kept_tokens=total, budget=high)
    head = leading_instructions(messages)
    cuts = valid_cuts(messages, head)
    cut = watermark_cut(messages, counts, head, high, min(low, high), overhead, cuts=cuts)
    prefix = [0, *accumulate(counts)]
    kept_tokens = prefix[head] + overhead + prefix[-1] - prefix[cut]
    if kept_tokens > high:
        required = prefix[head] + overhead + prefix[-1] - prefix[cuts[-1]] if cuts else total
        return TrimResult(
            messages=messages,
            dropped_messages=0,
            dropped_tokens=0,
            kept_tokens=required,
            budget=high,
            fits=False,
            required_tokens=required,
        )
    return TrimResult(
        messages=messages[:head] + messages[cut:],
        dropped_messages=cut - head,
        dropped_tokens=total - kept_tokens,
        kept_tokens=kept_tokens,
        budget=high,
    )


def watermark_cut(
    messages: Sequence[Message],
    counts: Sequence[int],
    head: int,
    high: int,
    low: int,
    overhead: int = 0,
    *,
    cuts: Sequence[int] | None = None,
) -> int:
    """Where the kept conversation resumes after the instructions (`head`: nothing dropped).

    Replays the conversation's growth. At every prefix `messages[:k]` a client could have sent
    (one that does not end on an assistant message; and the whole conversation), if the
    instructions plus `messages[cut:k]` pass `high`, the cut moves forward to an allowed point
    (`core.valid_cuts` of the whole conversation) in `(cut, k - 1]`, the first that fits:

    1. the first point on a user message where the prompt fits `low`;
    2. else the last point on a user message where it fits `high` (the nearest to `low`);
    3. else the first point where it fits `low`, else the last point (the newest unit alone).

    `cuts` saves recomputing `valid_cuts(messages, head)` when the caller has it.
    """
    if cuts is None:
        cuts = valid_cuts(messages, head)
    if not cuts:
        return head
    n = len(messages)
    prefix = [0, *accumulate(counts)]
    base = prefix[head] + overhead
    cut_sums = [prefix[c] for c in cuts]  # non-decreasing: counts are >= 0
    # Into `cuts`: next_user[i] is the first index j >= i on a user message (len(cuts): none),
    # last_user[i] the last index j <= i on one (-1: none).
    on_user = [messages[c].get("role") == "user" for c in cuts]
    next_user = [len(cuts)] * (len(cuts) + 1)
    for i in range(len(cuts) - 1, -1, -1):
        next_user[i] = i if on_user[i] else next_user[i + 1]
    last_user = [-1] * len(cuts)
    for i in range(len(cuts)):
        last_user[i] = i if on_user[i] else last_user[i - 1] if i else -1
    cut = head
    for k in range(head + 1, n + 1):
        if k < n and messages[k - 1].get("role") == "assistant":
            continue  # no request ends here: the next one decides
        grown = base + prefix[k]
        if grown - prefix[cut] <= high:
            continue
        # The allowed points in (cut, k - 1] are cuts[lo:hi]; from fits_high (fits_low) on, the
        # prompt fits the high (low) mark: prefix[c] >= grown - mark.
        lo = bisect_left(cuts, cut + 1)
        hi = bisect_left(cuts, k)
        if lo >= hi:
            continue  # nothing more may go
        fits_high = bisect_left(cut_sums, grown - high, lo, hi)
        fits_low = bisect_left(cut_sums, grown - low, fits_high, hi)
        if next_user[fits_low] < hi:
            cut = cuts[next_user[fits_low]]
        elif last_user[hi - 1] >= fits_high:
            cut = cuts[last_user[hi - 1]]
        elif fits_low < hi:
            cut = cuts[fits_low]
        else:
            cut = cuts[hi - 1]
    return cut
