"""Cache-aware routing with nothing to choose: no prompt read, no scores, `only_choice` (issue 17);
with a choice, the explanation the access log carries is the whole one, built when asked."""

from __future__ import annotations

import asyncio

from server.config import ServedModel
from server.gateway.replicas.pool import EnginePool
from server.gateway.settings import Routing

BODY = {"model": "m", "messages": [{"role": "user", "content": "a long shared system prompt " * 40}]}


def model_of(*urls: str):
    return EnginePool.from_models([ServedModel("m", list(urls))]).get("m")


def test_one_replica_reads_no_prompt_and_is_the_only_choice():
    model = model_of("http://a:1")
    assert asyncio.run(model.prompt(Routing(), BODY)) is None
    decision = model.route(Routing(), prompt=None)
    assert decision is not None and decision.engine is model.engines[0] and model.engines[0].outstanding == 1
    assert decision.explain() == {"engine": "a:1", "policy": "cache_aware", "reason": "only_choice"}


def test_two_replicas_one_down_is_the_only_choice_and_still_records_where_the_prompt_went():
    model = model_of("http://a:1", "http://b:1")
    a, b = model.engines
    b.mark_down("refused")
    prompt = asyncio.run(model.prompt(Routing(), BODY))
    assert prompt is not None  # two replicas: the prompt is read
    decision = model.route(Routing(), prompt=prompt)
    assert decision is not None and decision.engine is a and decision.reason == "only_choice"
    b.healthy = True
    again = model.route(Routing(), prompt=prompt)
    assert again is not None and again.engine is a and again.reason != "only_choice"
    explained = again.explain()  # a choice: the full explanation, with a's cached prefix matched
    assert explained["source"] == "approximate" and explained["matched"]["a:1"] > 0
    assert explained["matched"]["b:1"] == 0 and set(explained["scores"]) == {"a:1", "b:1"}
