"""The workloads: what the simulated users send.

Every scenario is a stream of `Session`s. A session is a fixed prefix (system prompt, retrieved
context), then user turns sent one after another; each answer joins the history the next turn
carries. A single request is a session of one turn. Generation is deterministic: session `i`
of a scenario depends only on the seed and `i` (so A/B runs and reruns send the same prompts).

- `itinerary`: the trip-planning assistant. Shared ~500-char system prompt, ~2,000 chars of
  retrieved points of interest (per session), then many turns with a growing history.
- `articles`: batch generation. N prompts sharing one ~500-char system prompt, distinct topics.
- `random`: unrelated prompts of fixed or distributed input length and output length.
- `file`: a JSONL file of requests or conversations (`load_file` documents the line formats).
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from loadtest.texts import (
    ANGLES,
    ARTICLES_SYSTEM_PROMPT,
    CATEGORIES,
    CITIES,
    FEATURES,
    NAMES,
    PREFERENCES,
    QUESTIONS,
    SUBJECTS,
    SYSTEM_PROMPT,
    WORDS,
)

SCENARIOS = ("itinerary", "articles", "random", "file")


class ScenarioError(ValueError):
    """A scenario cannot be built from the given options or file."""


@dataclass(frozen=True)
class Session:
    """One simulated user: prefix messages, then one user message per request."""

    id: str
    prefix: tuple[dict, ...]
    turns: tuple[dict, ...]
    max_tokens: tuple[int | None, ...]

    def __post_init__(self) -> None:
        if len(self.max_tokens) != len(self.turns):
            raise ScenarioError("one max_tokens per turn")


def fit(text: str, chars: int) -> str:
    """`text` repeated or cut (at a space where possible) to about `chars` characters."""
    if chars <= 0:
        return ""
    while len(text) < chars:
        text = text + " " + text
    cut = text[:chars]
    space = cut.rfind(" ")
    return cut[:space] if space > chars * 0.9 else cut


def _rng(seed: int, *parts: object) -> random.Random:
    return random.Random(":".join(str(p) for p in (seed, *parts)))


def poi_context(rng: random.Random, city: str, chars: int) -> str:
    """Retrieved points of interest for `city`, about `chars` characters, RAG style."""
    lines = [f"Retrieved points of interest for {city}:"]
    size = len(lines[0])
    number = 1
    while size < chars:
        category = rng.choice(CATEGORIES)
        opens, closes = rng.randint(7, 11), rng.randint(16, 23)
        line = (
            f"{number}. {rng.choice(NAMES)} {category.title()} ({category}): open "
            f"{opens:02d}:{rng.choice(('00', '30'))}-{closes:02d}:00, "
            f"{rng.randint(0, 30)} euros, {rng.randint(1, 60) / 10:.1f} km from the hotel, "
            f"rating {rng.randint(30, 50) / 10:.1f}, {rng.choice(FEATURES)}."
        )
        lines.append(line)
        size += len(line) + 1
        number += 1
    return fit("\n".join(lines), chars)


def itinerary(
    seed: int, *, turns: int = 8, system_chars: int = 500, context_chars: int = 2000, max_tokens: int | None = 64
) -> Iterator[Session]:
    """Endless trip-planning sessions (see the module docstring)."""
    if turns < 1:
        raise ScenarioError("--turns must be at least 1")
    system = fit(SYSTEM_PROMPT, system_chars)
    for index in itertools.count():
        rng = _rng(seed, "itinerary", index)
        city = rng.choice(CITIES)
        context = poi_context(rng, city, context_chars)
        prefix = ({"role": "system", "content": f"{system}\n\n{context}" if context else system},)
        questions = []
        for turn in range(turns):
            question = rng.choice(QUESTIONS).format(
                day=turn // 2 + 1, poi=f"{rng.choice(NAMES)} {rng.choice(CATEGORIES)}", pref=rng.choice(PREFERENCES)
            )
            questions.append({"role": "user", "content": question})
        yield Session(f"itinerary-{seed}-{index}", prefix, tuple(questions), (max_tokens,) * turns)


def articles(
    seed: int, *, num_prompts: int = 100, system_chars: int = 500, max_tokens: int | None = 64
) -> Iterator[Session]:
    """`num_prompts` single-turn article requests sharing one system prompt, distinct topics."""
    system = ({"role": "system", "content": fit(ARTICLES_SYSTEM_PROMPT, system_chars)},)
    topics = [(s, a) for s in SUBJECTS for a in ANGLES]
    _rng(seed, "articles").shuffle(topics)
    for index in range(num_prompts):
        subject, angle = topics[index % len(topics)]
        rng = _rng(seed, "articles", index)
        city = rng.choice(CITIES)
        cycle = f" (part {index // len(topics) + 1})" if index >= len(topics) else ""
        prompt = (
            f"Write an article about {subject} in {city}, focusing on {angle}{cycle}. "
            f"Mention {rng.choice(FEATURES)} and aim for about {rng.randint(4, 9)}00 words."
        )
        yield Session(f"articles-{seed}-{index}", system, ({"role": "user", "content": prompt},), (max_tokens,))


def sample_length(rng: random.Random, mean: int, dist: str, spread: float) -> int:
    """One length: `fixed` = mean; `uniform` in mean*(1±spread); `normal` sd = mean*spread."""
    if dist == "fixed":
        return max(1, mean)
    if dist == "uniform":
        return max(1, round(rng.uniform(mean * (1 - spread), mean * (1 + spread))))
    if dist == "normal":
        return max(1, round(rng.gauss(mean, mean * spread)))
    raise ScenarioError(f"unknown length distribution {dist!r} (fixed, uniform, normal)")


def random_prompts(
    seed: int, *, input_chars: int = 1000, max_tokens: int = 64, dist: str = "fixed", spread: float = 0.25
) -> Iterator[Session]:
    """Endless unrelated prompts of random words; lengths per `sample_length`.

    Each prompt starts with its own index so that no two share a cacheable prefix.
    """
    for index in itertools.count():
        rng = _rng(seed, "random", index)
        size = sample_length(rng, input_chars, dist, spread)
        words = [f"{index}:"]
        length = len(words[0])
        while length < size:
            word = rng.choice(WORDS)
            words.append(word)
            length += len(word) + 1
        text = " ".join(words)[:size]
        yield Session(
            f"random-{seed}-{index}",
            (),
            ({"role": "user", "content": text},),
            (sample_length(rng, max_tokens, dist, spread),),
        )


def load_file(path: str | Path, *, max_tokens: int | None = 64) -> list[Session]:
    """Sessions from a JSONL file; one JSON object per line, any of:

    - `{"messages": [...], "max_tokens": 32}`: one request; the last message is the turn;
    - `{"prompt": "text"}`: one request with a single user message;
    - `{"system": "...", "turns": ["first question", "second", ...]}`: a conversation; each
      turn is sent after the previous answer arrived, with the history so far.

    `max_tokens` per line is optional (the command line's value otherwise); `id` names the
    session. Blank lines and lines starting with `#` are skipped.
    """
    sessions = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            entry = json.loads(line)
        except ValueError as exc:
            raise ScenarioError(f"{path}:{number}: not JSON: {exc}") from None
        sessions.append(_session_from_entry(entry, f"{path}:{number}", max_tokens))
    if not sessions:
        raise ScenarioError(f"{path}: no requests in the file")
    return sessions


def _session_from_entry(entry: object, where: str, default_max: int | None) -> Session:
    if not isinstance(entry, dict):
        raise ScenarioError(f"{where}: expected a JSON object")
    max_tokens = entry.get("max_tokens", entry.get("max_completion_tokens", default_max))
    sid = str(entry.get("id") or where)
    if "messages" in entry:
        messages = entry["messages"]
        if (
            not isinstance(messages, list)
            or not messages
            or not all(isinstance(m, dict) and "role" in m for m in messages)
        ):
            raise ScenarioError(f"{where}: 'messages' must be a non-empty list of messages")
        return Session(sid, tuple(messages[:-1]), (messages[-1],), (max_tokens,))
    if "prompt" in entry:
        return Session(sid, (), ({"role": "user", "content": str(entry["prompt"])},), (max_tokens,))
    if "turns" in entry:
        turns = entry["turns"]
        if not isinstance(turns, list) or not turns:
            raise ScenarioError(f"{where}: 'turns' must be a non-empty list")
        prefix = ({"role": "system", "content": str(entry["system"])},) if entry.get("system") else ()
        messages = tuple(t if isinstance(t, dict) else {"role": "user", "content": str(t)} for t in turns)
        return Session(sid, prefix, messages, (max_tokens,) * len(messages))
    raise ScenarioError(f"{where}: expected one of 'messages', 'prompt' or 'turns'")


def build(
    name: str,
    *,
    seed: int,
    max_tokens: int | None,
    turns: int = 8,
    system_chars: int = 500,
    context_chars: int = 2000,
    num_prompts: int = 100,
    input_chars: int = 1000,
    length_dist: str = "fixed",
    length_spread: float = 0.25,
    file: str | None = None,
) -> Iterable[Session]:
    """The sessions of scenario `name` with the command line's options."""
    if name == "itinerary":
        return itinerary(
            seed, turns=turns, system_chars=system_chars, context_chars=context_chars, max_tokens=max_tokens
        )
    if name == "articles":
        return articles(seed, num_prompts=num_prompts, system_chars=system_chars, max_tokens=max_tokens)
    if name == "random":
        return random_prompts(
            seed, input_chars=input_chars, max_tokens=max_tokens or 64, dist=length_dist, spread=length_spread
        )
    if name == "file":
        if not file:
            raise ScenarioError("--scenario file needs --file PATH")
        return load_file(file, max_tokens=max_tokens)
    raise ScenarioError(f"unknown scenario {name!r} ({', '.join(SCENARIOS)})")
