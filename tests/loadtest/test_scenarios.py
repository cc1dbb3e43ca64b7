"""Scenario generation: sizes, shared prefixes, determinism, the JSONL file formats."""

import itertools
import json

import pytest

from loadtest import scenarios
from loadtest.scenarios import ScenarioError, Session


def take(iterable, n):
    return list(itertools.islice(iterable, n))


def test_itinerary_sizes_and_shared_system_prompt():
    sessions = take(scenarios.itinerary(3, turns=6), 5)
    for session in sessions:
        assert len(session.turns) == 6 and session.max_tokens == (64,) * 6
        (system,) = session.prefix
        assert system["role"] == "system"
        prompt, context = system["content"].split("\n\n", 1)
        assert 450 <= len(prompt) <= 500
        assert 1900 <= len(context) <= 2000
        assert context.startswith("Retrieved points of interest for ")
        assert all(t["role"] == "user" and 40 < len(t["content"]) < 300 for t in session.turns)
    prompts = {s.prefix[0]["content"].split("\n\n", 1)[0] for s in sessions}
    contexts = {s.prefix[0]["content"].split("\n\n", 1)[1] for s in sessions}
    assert len(prompts) == 1  # one system prompt shared by every session: a cacheable prefix
    assert len(contexts) == 5  # retrieved context differs per session


@pytest.mark.parametrize("system_chars, context_chars", [(200, 800), (1000, 4000), (500, 0)])
def test_itinerary_sizes_follow_the_options(system_chars, context_chars):
    (session,) = take(scenarios.itinerary(0, system_chars=system_chars, context_chars=context_chars), 1)
    content = session.prefix[0]["content"]
    expected = system_chars + (context_chars + 2 if context_chars else 0)
    assert expected * 0.9 <= len(content) <= expected


def test_articles_share_one_system_prompt_and_differ_in_topic():
    sessions = list(scenarios.articles(1))
    assert len(sessions) == 100
    assert len({s.prefix[0]["content"] for s in sessions}) == 1
    assert 450 <= len(sessions[0].prefix[0]["content"]) <= 500
    assert len({s.turns[0]["content"] for s in sessions}) == 100
    assert all(len(s.turns) == 1 for s in sessions)
    assert len(list(scenarios.articles(1, num_prompts=250))) == 250
    assert len({s.turns[0]["content"] for s in scenarios.articles(1, num_prompts=250)}) == 250


def test_random_lengths_fixed_and_distributed():
    fixed = take(scenarios.random_prompts(0, input_chars=300, max_tokens=20), 20)
    assert {len(s.turns[0]["content"]) for s in fixed} == {300}
    assert {s.max_tokens for s in fixed} == {(20,)}
    # no two prompts share a prefix beyond their first characters
    assert len({s.turns[0]["content"][:8] for s in fixed}) == 20
    uniform = take(scenarios.random_prompts(0, input_chars=1000, max_tokens=100, dist="uniform", spread=0.5), 200)
    sizes = [len(s.turns[0]["content"]) for s in uniform]
    outs = [s.max_tokens[0] for s in uniform]
    assert 500 <= min(sizes) < 650 and 1350 < max(sizes) <= 1500
    assert 50 <= min(outs) and max(outs) <= 150 and len(set(outs)) > 20
    normal = take(scenarios.random_prompts(0, dist="normal", spread=0.2), 200)
    sizes = [len(s.turns[0]["content"]) for s in normal]
    assert 900 < sum(sizes) / len(sizes) < 1100
    with pytest.raises(ScenarioError):
        take(scenarios.random_prompts(0, dist="zipf"), 1)


@pytest.mark.parametrize("name", ["itinerary", "articles", "random"])
def test_same_seed_same_sessions_other_seed_other_sessions(name):
    def build(seed):
        return take(scenarios.build(name, seed=seed, max_tokens=32), 10)

    assert build(5) == build(5)
    assert build(5) != build(6)


def test_session_i_does_not_depend_on_how_many_are_drawn():
    assert take(scenarios.itinerary(2), 3)[2] == take(scenarios.itinerary(2), 10)[2]


def test_file_formats(tmp_path):
    path = tmp_path / "traffic.jsonl"
    lines = [
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}], "max_tokens": 5},
        {"prompt": "hello"},
        {"id": "trip", "system": "plan trips", "turns": ["day one?", "day two?"]},
    ]
    path.write_text("# my traffic\n" + "\n".join(json.dumps(x) for x in lines) + "\n\n")
    a, b, c = scenarios.load_file(path, max_tokens=7)
    assert a == Session(
        f"{path}:2", ({"role": "system", "content": "be brief"},), ({"role": "user", "content": "hi"},), (5,)
    )
    assert b.turns == ({"role": "user", "content": "hello"},) and b.max_tokens == (7,)
    assert c.id == "trip" and len(c.turns) == 2 and c.prefix[0]["content"] == "plan trips"


@pytest.mark.parametrize("line", ['{"nothing": 1}', "not json", '{"messages": []}', '{"turns": "x"}', "[1]"])
def test_file_errors_name_the_line(tmp_path, line):
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ScenarioError, match="bad.jsonl:1"):
        scenarios.load_file(path)


def test_build_needs_a_file_for_the_file_scenario():
    with pytest.raises(ScenarioError):
        scenarios.build("file", seed=0, max_tokens=8)
