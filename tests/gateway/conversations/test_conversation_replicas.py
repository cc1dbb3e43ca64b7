"""Issue 33's conversation: 30 turns continued by `previous_response_id` with the real OpenAI SDK,
through the gateway in front of the session's two real tiny replicas (`real_replicas`).

The replica that served turn 10 is killed (SIGKILL; its supervisor restarts it) and the
conversation goes on; at turn 20 the gateway itself is stopped and a new one started on the same
SQLite file, and it goes on. Every turn is routed like any other request (cache-aware: the router's
choice is logged and both replicas answer); trimming starts as the chain outgrows the model, and
over the trimmed turns the engines find at least 80% of the prompt tokens in their prefix caches
(the watermarks keep the same cut from turn to turn). Afterwards `retrieve` and `input_items`
give back exactly what each turn sent and received."""

from __future__ import annotations

import logging
import os
import random
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import openai
import pytest

from server.config import TrimmingConfig
from server.deploy.plan import served_model
from server.gateway.settings import GatewaySettings
from tests.gateway.conftest import Gateway, served_gateway
from tests.support import wait_for

pytestmark = pytest.mark.engine

log = logging.getLogger("tests.conversation")

TURNS = 30
KILL_AFTER_TURN = 10
RESTART_AFTER_TURN = 20
ANSWER_TOKENS = 16
WORDS = (
    "the quick brown fox jumps over a lazy dog while travellers plan an itinerary across "
    "Europe by train with hotels museums markets and food"
).split()


def text(rng: random.Random, chars: int) -> str:
    words: list[str] = []
    while sum(len(w) + 1 for w in words) < chars:
        words.append(rng.choice(WORDS))
    return " ".join(words)[:chars]


@contextmanager
def gateway_on(replicas: list[Any], store: Path, folder: Path, seen: dict[str, str]) -> Iterator[Gateway]:
    settings = GatewaySettings.model_validate(
        {
            "responses_store": {"backend": "sqlite", "path": str(store)},
            "health": {"interval": 0.5, "timeout": 5.0, "unhealthy_after": 1},
            "retries": {"max_attempts": 3, "backoff": 0.05},
        }
    )
    profile = replicas[0].profile
    models = [served_model(replicas[0].model, [r.url for r in replicas], profile, trimming=TrimmingConfig(mode="auto"))]

    def access(**fields: Any) -> None:
        if fields.get("engine"):
            seen[fields["request_id"]] = fields["engine"]
            log.info("turn %s: routed to %s (%s)", fields["request_id"], fields["engine"], fields.get("routing"))

    with served_gateway(settings, models, 1, folder, log_request=access) as gateway:
        yield gateway


def test_thirty_turns_survive_a_killed_replica_and_a_gateway_restart_and_stay_cached(real_replicas, tmp_path):
    store = tmp_path / "data" / "responses.sqlite3"
    seen: dict[str, str] = {}  # request id -> the engine the router chose
    rng = random.Random(33)
    # The shape of the chat trimming experiment (trimming/test_engine_e2e.py): a long stable head (a
    # system prompt and retrieved documents, here the instructions) and short turns.
    instructions = "You are the travel desk. " + text(rng, 500) + "\nRetrieved documents:\n" + text(rng, 2000)
    sent: list[tuple[str, str]] = []  # (response id, the input text of its turn)
    answers: dict[str, Any] = {}
    engine_of_turn: dict[int, str] = {}
    prompt = cached = trimmed = 0
    previous: str | None = None
    urls: dict[str, str] = {}
    gateway_cm = gateway_on(real_replicas, store, tmp_path, seen)
    gateway = gateway_cm.__enter__()
    try:
        for turn in range(1, TURNS + 1):
            if turn == RESTART_AFTER_TURN + 1:  # the gateway restarts on the same file
                gateway_cm.__exit__(None, None, None)
                gateway_cm = gateway_on(real_replicas, store, tmp_path, seen)
                gateway = gateway_cm.__enter__()
            urls = {e.id: e.url for e in gateway.state.upstreams.models[real_replicas[0].model].engines}
            question = f"Question {turn}: " + text(rng, 80)
            rid = f"conv-turn-{turn}"
            with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=2, timeout=300) as sdk:
                raw = sdk.responses.with_raw_response.create(
                    model=real_replicas[0].model,
                    input=question,
                    instructions=instructions,
                    previous_response_id=previous,
                    max_output_tokens=ANSWER_TOKENS,
                    temperature=0,
                    extra_body={"ignore_eos": True},
                    extra_headers={"x-request-id": rid},
                )
            answer = raw.parse()
            log.info(
                "turn %d: %s, trim %s (dropped %s), usage %s",
                turn,
                answer.status,
                raw.headers.get("x-trim-status"),
                raw.headers.get("x-trimmed-messages"),
                answer.usage,
            )
            assert answer.status in ("completed", "incomplete") and answer.previous_response_id == previous
            wait_for(lambda rid=rid: rid in seen, what=f"the access log line of {rid}")
            engine_of_turn[turn] = seen[rid]
            if raw.headers.get("x-trim-status") == "trimmed":
                trimmed += 1
                usage = answer.usage
                assert usage is not None and usage.input_tokens_details is not None
                prompt += usage.input_tokens
                cached += usage.input_tokens_details.cached_tokens or 0
            sent.append((answer.id, question))
            answers[answer.id] = answer
            previous = answer.id
            if turn == KILL_AFTER_TURN:  # kill the replica that served this turn; its supervisor restarts it
                victim = next(r for r in real_replicas if r.url == urls[seen[rid]])
                pid = victim.engine_pid()
                assert pid is not None
                log.info("killing the engine of %s (pid %d) after turn %d", victim.url, pid, turn)
                os.killpg(pid, signal.SIGKILL)  # vLLM's API server and its engine core: its own process group
        # Retrieve and input_items give back what each turn sent and received.
        with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=60) as sdk:
            for response_id, question in sent:
                assert sdk.responses.retrieve(response_id).model_dump() == answers[response_id].model_dump()
                items = sdk.responses.input_items.list(response_id).data
                assert [[c.text for c in item.content] for item in items] == [[question]]
    finally:
        gateway_cm.__exit__(None, None, None)
    used = set(engine_of_turn.values())
    log.info("engines by turn: %s", engine_of_turn)
    assert len(used) == 2, f"both replicas answered: {engine_of_turn}"
    assert engine_of_turn[KILL_AFTER_TURN + 1] != engine_of_turn[KILL_AFTER_TURN]  # the dead one could not
    assert trimmed >= 8, f"trimming started and went on ({trimmed} trimmed turns)"
    share = cached / prompt
    log.info("cached share over %d trimmed turns: %.3f", trimmed, share)
    assert share >= 0.8, f"cached share of prompt tokens over the trimmed turns: {share:.3f}"
