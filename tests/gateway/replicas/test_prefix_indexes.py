"""The prefix indexes without I/O: chained block keys, the approximate record, the precise index."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from server.gateway.replicas.approximate import ApproximateIndex
from server.gateway.replicas.blocks import prompt_text, text_blocks, token_blocks
from server.gateway.replicas.precise import PreciseIndex

SYSTEM = "You are the assistant of tenant {}. " + "Shared rules. " * 40


def chat(tenant: int, question: str) -> dict[str, object]:
    return {"messages": [{"role": "system", "content": SYSTEM.format(tenant)}, {"role": "user", "content": question}]}


# -- block keys ----------------------------------------------------------------------------------


@given(
    st.lists(st.integers(0, 50_000), max_size=60),
    st.lists(st.integers(0, 50_000), max_size=60),
    st.sampled_from([1, 4, 16]),
)
def test_token_keys_are_equal_exactly_as_far_as_the_full_blocks_are(a: list[int], b: list[int], size: int) -> None:
    ka, kb = token_blocks(a, size), token_blocks(b, size)
    assert len(ka) == len(a) // size
    common = 0
    while common < min(len(a), len(b)) and a[common] == b[common]:
        common += 1
    same = 0
    while same < min(len(ka), len(kb)) and ka[same] == kb[same]:
        same += 1
    assert same == min(common // size, len(ka), len(kb))


def test_an_adapter_keeps_its_blocks_apart_from_the_base_models():
    tokens = list(range(32))
    assert token_blocks(tokens, 16) != token_blocks(tokens, 16, namespace="sql-lora")
    assert token_blocks(tokens, 16, namespace="sql-lora") == token_blocks(tokens, 16, namespace="sql-lora")


def test_text_blocks_of_two_tenants_share_the_system_prompts_common_part_only():
    one, two = (text_blocks(prompt_text(chat(t, "Hi")) or "", 64) for t in (1, 2))
    assert one[0] != two[0]  # the tenant's name is in the first block
    ta, tb = (prompt_text(chat(1, q)) or "" for q in ("Where?", "When?" * 20))
    common = next(i for i, (x, y) in enumerate(zip(ta, tb, strict=False)) if x != y)
    a, b = text_blocks(ta, 64), text_blocks(tb, 64)
    shared = sum(1 for x, y in zip(a, b, strict=False) if x == y)
    assert shared == common // 64 and a[:shared] == b[:shared]


def test_prompt_text_reads_chat_and_completions_and_nothing_else():
    assert prompt_text({"prompt": "abc"}) == "abc"
    assert prompt_text({"prompt": ["abc", "def"]}) == "abc"
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url"}]}]}
    assert prompt_text(parts) == "\x1euser\x1fhi"
    assert prompt_text({"input": "embed me"}) is None
    assert prompt_text({"prompt": [1, 2, 3]}) is None


# -- the approximate index -----------------------------------------------------------------------


def test_approximate_matches_the_leading_blocks_sent_to_each_replica():
    index = ApproximateIndex(ttl=60)
    index.record("a", [1, 2, 3], now=0)
    assert index.matched("a", [1, 2, 3, 4], now=1) == 3
    assert index.matched("a", [1, 9, 3], now=1) == 1  # only leading blocks count
    assert index.matched("b", [1, 2, 3], now=1) == 0
    assert index.held("a") == 3


def test_approximate_entries_age_out():
    index = ApproximateIndex(ttl=10)
    index.record("a", [1, 2], now=0)
    index.record("a", [1], now=8)  # block 1 sent again: fresh
    assert index.matched("a", [1, 2], now=9) == 2
    assert index.matched("a", [1, 2], now=15) == 1
    index.record("a", [7], now=15)  # recording drops what aged out
    assert index.held("a") == 2


def test_approximate_memory_is_bounded_oldest_first():
    index = ApproximateIndex(ttl=1e9, capacity=4)
    for t, key in enumerate(range(10)):
        index.record("a", [key], now=t)
    assert index.held("a") == 4
    assert index.matched("a", [6], now=10) == 1 and index.matched("a", [5], now=10) == 0
    index.set_capacity("a", 2)
    assert index.held("a") == 2 and index.capacity("a") == 2
    index.forget("a")
    assert index.held("a") == 0


# -- the precise index ---------------------------------------------------------------------------


def stored(
    index: PreciseIndex, engine: str, hashes: list[object], parent: object, tokens: list[int], size: int = 4
) -> int:
    return index.stored(engine, block_hashes=hashes, parent=parent, token_ids=tokens, block_size=size)


def test_blocks_are_keyed_from_their_token_ids_and_chained_through_the_parent():
    index = PreciseIndex()
    prompt = list(range(100, 112))  # three blocks of 4
    assert stored(index, "a", [b"h1", b"h2"], None, prompt[:8]) == 2
    assert stored(index, "a", [b"h3"], b"h2", prompt[8:12]) == 1  # the engine stores the next block later
    keys = token_blocks(prompt, 4)
    assert index.matched("a", keys, now=0) == 3
    assert index.matched("a", token_blocks([*prompt[:8], 0, 0, 0, 0], 4), now=0) == 2
    assert index.matched("b", keys, now=0) == 0 and index.held("a") == 3 and index.block_size("a") == 4


def test_a_block_whose_parent_is_unknown_cannot_be_keyed_and_is_skipped():
    index = PreciseIndex()
    assert stored(index, "a", [b"h9"], b"never-seen", [1, 2, 3, 4]) == 0
    assert index.held("a") == 0 and index.state("a").skipped == 1
    assert stored(index, "a", [b"h1", b"h2"], None, [1, 2, 3]) == 0  # token ids that do not fill the blocks


def test_removed_blocks_are_no_longer_held():
    index = PreciseIndex()
    stored(index, "a", [1, 2], None, list(range(8)))
    index.removed("a", [2, 999])  # an unknown hash is ignored
    keys = token_blocks(list(range(8)), 4)
    assert index.matched("a", keys, now=0) == 1 and index.held("a") == 1
    stored(index, "a", [1], None, list(range(4)))  # announced again: still one block
    index.removed("a", [1])
    assert index.held("a") == 0


def test_purge_forgets_an_engine_and_counts_why():
    index = PreciseIndex()
    stored(index, "a", [1], None, list(range(4)))
    stored(index, "b", [1], None, list(range(4)))
    index.set_live("a", True)
    index.purge("a", "gap")
    assert index.held("a") == 0 and index.held("b") == 1
    assert index.state("a").purges == {"gap": 1}
    assert index.is_live("a")  # whether events still arrive is the subscriber's to say
    assert stored(index, "a", [5], 1, list(range(4, 8))) == 0  # its old chain is gone too


def test_a_new_block_size_means_a_new_engine():
    index = PreciseIndex()
    stored(index, "a", [1], None, list(range(4)))
    stored(index, "a", [7], None, list(range(8)), size=8)
    assert index.block_size("a") == 8 and index.held("a") == 1 and index.state("a").purges == {"block_size": 1}


def test_speculative_entries_count_until_they_expire():
    index = PreciseIndex(speculative_ttl=2.0)
    keys = token_blocks(list(range(12)), 4)
    index.speculate("a", keys, now=10.0)
    assert index.matched("a", keys, now=11.0) == 3
    assert index.matched("a", keys, now=12.5) == 0
    stored(index, "a", [1], None, list(range(4)))  # the event arrived: held for good
    assert index.matched("a", keys, now=12.5) == 1


def test_memory_is_bounded():
    index = PreciseIndex(max_blocks=3)
    stored(index, "a", [1, 2, 3, 4], None, list(range(16)))
    assert index.held("a") == 0 and index.state("a").purges == {"overflow": 1}
    index.speculate("a", list(range(10)), now=0)
    assert len(index.state("a").speculative) <= 3


def test_a_speculative_entry_ends_when_the_events_speak_of_its_block():
    """Issue 34's quiet-machine runs: a tenant's blocks were evicted within a few requests, and the
    speculative entries still counted them held until they expired (2 s: 60 requests at that pace),
    so 37 of 72 requests sent to their tenant's blocks a phase found only the shared prefix there."""
    index = PreciseIndex(speculative_ttl=2.0)
    prompt = list(range(12))
    keys = token_blocks(prompt, 4)
    index.speculate("a", keys, now=10.0)
    assert index.matched("a", keys, now=10.1) == 3  # routed: counted before its events arrive
    stored(index, "a", [1, 2, 3], None, prompt)  # stored: held as the events say
    index.removed("a", [2, 3])  # then evicted, long before the entry would expire
    assert index.matched("a", keys, now=10.2) == 1
    assert index.matched("a", keys, now=99.0) == 1  # the stored first block stays until removed
    index.speculate("a", keys, now=20.0)  # routed again: counted again until the events say otherwise
    assert index.matched("a", keys, now=20.1) == 3
    index.removed("a", [1])
    assert index.matched("a", keys, now=20.2) == 0  # its first block is gone: nothing leads there


def test_an_eviction_of_another_engines_copy_leaves_the_speculation_alone():
    index = PreciseIndex(speculative_ttl=2.0)
    prompt = list(range(8))
    keys = token_blocks(prompt, 4)
    stored(index, "b", [1, 2], None, prompt)
    index.speculate("a", keys, now=0.0)
    index.removed("b", [1, 2])
    assert index.matched("a", keys, now=0.5) == 2 and index.matched("b", keys, now=0.5) == 0
