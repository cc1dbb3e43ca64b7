"""cache_isolation: tenant against real vLLM (the session's two tiny-cpu-routing replicas: KV
events on, prompt-token details on), with the OpenAI SDK as the client.

- Through a gateway on both replicas (cache_aware, with either prefix index; the precise one
  without speculative entries, so a repeat is routed by the engines' own KV events alone):
  tenant A's repeat hits its cached system prompt on the replica holding it; tenant B's first
  request with A's system prompt reports 0 cached tokens, and B's repeat then hits, on the
  replica holding B's blocks; two shared tenants do share (the control: the zero is the salt's
  doing).
- Through a second gateway (another replica of the gateway, same secret) on the one engine that
  holds A's blocks, so routing cannot explain a miss: a third isolated tenant gets 0 cached
  tokens for A's prompt there while A's request hits (the salt is the same in every gateway
  replica); a client's own `cache_salt` is dropped (two isolated tenants sending one chosen salt
  share nothing, while two shared tenants sending one do).
- The salts appear in no gateway log line and in no answer.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client import CollectorRegistry

from server.deploy.plan import plan_deployment
from server.engine.render import local_kv_events_port
from server.gateway.app import create_app
from server.gateway.http.seam import protocol_for
from server.gateway.observability.logs import log_request
from server.gateway.settings import GatewaySettings
from server.gateway.tenants.isolation import tenant_salt
from tests.support import serve_in_thread, wait_for

pytestmark = pytest.mark.engine

SECRET = "fedcba9876543210" * 4
KEYS = {"planner": "sk-a", "articles": "sk-b", "reports": "sk-r", "team-c": "sk-c", "team-d": "sk-d"}
ISOLATED = ("planner", "articles", "reports")
# About 4 blocks of 128 tokens of the tiny tokenizer (~1.9 characters a token): a system prompt
# of several full blocks, well inside the replicas' 48 blocks.
HOUSE = "You are the travel desk of the {}. Plan every trip with care, cite the prices, never book without asking. "


def system(name: str) -> str:
    return HOUSE.format(name) * 10


def settings(urls: list[str], index: str = "precise") -> GatewaySettings:
    events = [f"tcp://127.0.0.1:{local_kv_events_port(int(url.rsplit(':', 1)[1]))}" for url in urls]
    return GatewaySettings.model_validate(
        {
            "models": [{"name": "tiny", "urls": urls, "kv_events": events}],
            "routing": {"policy": "cache_aware", "prefix_index": index, "speculative_ttl": 0.0},
            "health": {"interval": 0.2, "timeout": 10.0},
            "tenants": [
                {"name": name, "api_keys": [key], "cache_isolation": "tenant" if name in ISOLATED else "shared"}
                for name, key in KEYS.items()
            ],
        }
    )


class Gateway:
    """An in-process gateway on `urls`, its access-log fields by request id."""

    def __init__(self, url: str, app: Any, index: str) -> None:
        self.url, self.app, self.index = url, app, index
        self.lines: dict[str, dict[str, Any]] = {}

    def precise(self) -> Any:
        return self.app.state.upstreams.get("tiny").cache.precise

    def ask(self, tenant: str, system_prompt: str, question: str, **extra: Any) -> tuple[int, str, dict[str, Any]]:
        """(cached prompt tokens, the engine that served it, its access-log fields)."""
        with openai.OpenAI(base_url=f"{self.url}/v1", api_key=KEYS[tenant], max_retries=0, timeout=120) as client:
            raw = client.chat.completions.with_raw_response.create(
                model="tiny",
                messages=[{"role": "system", "content": system_prompt}, {"role": "user", "content": question}],
                max_tokens=2,
                extra_body=extra or None,
            )
            answer = raw.parse()
        rid = raw.headers["x-request-id"]
        line = wait_for(lambda: self.lines.get(rid), timeout=30, what=f"the access line of {rid}")
        assert answer.usage is not None and answer.usage.prompt_tokens_details is not None
        cached = answer.usage.prompt_tokens_details.cached_tokens or 0
        print(f"{tenant}: {answer.usage.prompt_tokens} prompt tokens, {cached} cached, on {line['engine']}")
        for salt in SALTS:
            assert salt not in raw.http_response.text and salt not in str(raw.headers)
        return cached, line["engine"], line

    def stored(self, engine: str) -> int:
        """Blocks `engine`'s events have said it stored, so far."""
        return self.precise().state(engine).stored

    def events_for(self, engine: str, since: int, blocks: int = 3) -> None:
        """Wait until `engine`'s events tell of `blocks` more blocks stored than `since` (the
        precise index; the approximate one recorded the prompt when it routed it)."""
        if self.index == "precise":
            wait_for(lambda: self.stored(engine) >= since + blocks, timeout=60, what=f"{engine}'s KV events")


SALTS = [tenant_salt(SECRET.encode(), name) for name in ISOLATED]


@contextlib.contextmanager
def gateway(urls: list[str], index: str = "precise") -> Iterator[Gateway]:
    config = settings(urls, index)
    models = plan_deployment(config.models).served_models()
    box: list[Gateway] = []

    def record(**fields: Any) -> None:
        log_request(**fields)  # the real access line too: the test reads the logs for salts
        box[0].lines[fields["request_id"]] = fields

    app = create_app(
        config, models, registry=CollectorRegistry(), log_request=record, environ={"GATEWAY_SALT_SECRET": SECRET}
    )
    with serve_in_thread(app, http=protocol_for(config)) as url:
        box.append(Gateway(url, app, index))
        engines = [e.id for e in app.state.upstreams.get("tiny").engines]
        if index == "precise":
            wait_for(lambda: all(box[0].precise().is_live(e) for e in engines), timeout=60, what="KV events live")
        yield box[0]


def reset_prefix_caches(urls: list[str]) -> None:
    for url in urls:
        httpx.post(f"{url}/reset_prefix_cache", timeout=60).raise_for_status()


@pytest.mark.parametrize("index", ["precise", "approximate"])
def test_isolated_tenants_never_hit_each_others_blocks_and_repeats_go_where_their_blocks_are(
    real_replicas, caplog, index
):
    caplog.set_level(logging.DEBUG)
    urls = [replica.url for replica in real_replicas]
    reset_prefix_caches(urls)
    with gateway(urls, index) as gw:
        # A's system prompt, then A's repeat: a hit, on the replica its events name.
        before = {e.id: gw.stored(e.id) for e in gw.app.state.upstreams.get("tiny").engines}
        first, a_engine, _ = gw.ask("planner", system("planner desk"), "Two days in Lisbon?")
        assert first == 0  # the caches were emptied
        gw.events_for(a_engine, before[a_engine])
        hit, engine, line = gw.ask("planner", system("planner desk"), "Three days in Porto?")
        assert engine == a_engine and line["routing"]["source"] == index, line["routing"]
        assert hit >= 3 * 128, hit
        # B, the same system prompt: nothing cached for it, wherever it went.
        before = {e.id: gw.stored(e.id) for e in gw.app.state.upstreams.get("tiny").engines}
        miss, b_engine, line = gw.ask("articles", system("planner desk"), "Two days in Lisbon?")
        assert miss == 0, (miss, b_engine, line["routing"])
        assert line["routing"]["matched"] == dict.fromkeys(line["routing"]["matched"], 0)  # the index agrees
        gw.events_for(b_engine, before[b_engine])
        hit, engine, line = gw.ask("articles", system("planner desk"), "Three days in Porto?")
        assert engine == b_engine and hit >= 3 * 128, (hit, engine, b_engine, line["routing"])
        # The control: two shared tenants with one system prompt do share its blocks.
        before = {e.id: gw.stored(e.id) for e in gw.app.state.upstreams.get("tiny").engines}
        _, c_engine, _ = gw.ask("team-c", system("common desk"), "A week in Rome?")
        gw.events_for(c_engine, before[c_engine])
        shared, engine, line = gw.ask("team-d", system("common desk"), "A week in Rome?")
        assert engine == c_engine and shared >= 3 * 128, (shared, line["routing"])

    # A second gateway replica (the same secret) on the one engine holding A's blocks: routing
    # cannot send anyone elsewhere, so a miss there is the salt's doing.
    with gateway([next(url for url in urls if url.endswith(a_engine.rsplit(":", 1)[1]))], index) as one:
        again, _, _ = one.ask("planner", system("planner desk"), "Four days in Faro?")
        assert again >= 3 * 128, again  # A's salt is the same in this gateway
        stranger, _, _ = one.ask("reports", system("planner desk"), "Four days in Faro?", cache_salt="guessed")
        assert stranger == 0, stranger
        # A client's own salt is dropped: two isolated tenants choosing one salt share nothing ...
        one.ask("articles", system("guessing desk"), "Ten days in Seville?", cache_salt="guessed")
        guessed, _, _ = one.ask("reports", system("guessing desk"), "Ten days in Seville?", cache_salt="guessed")
        assert guessed == 0, guessed
        # ... while shared tenants' salts are theirs: one salt, one cache.
        one.ask("team-c", system("salted desk"), "A month in Crete?", cache_salt="ours")
        theirs, _, _ = one.ask("team-d", system("salted desk"), "A month in Crete?", cache_salt="ours")
        assert theirs >= 3 * 128, theirs

    logs = caplog.text + "".join(str(record.__dict__) for record in caplog.records)
    assert '"tenant": "planner"' in logs or "'tenant': 'planner'" in logs  # the access lines were captured
    for salt in SALTS:
        assert salt not in logs
    engine_logs = "".join(Path(r.log_path).read_text(errors="replace") for r in real_replicas if r.log_path)
    for salt in SALTS:
        assert salt not in engine_logs  # vLLM logs no request parameters here either


def test_completions_and_responses_are_salted_too(real_replicas):
    """vLLM 0.32 takes `cache_salt` on /v1/completions and /v1/responses as on chat: an isolated
    tenant's repeat hits, another isolated tenant's same prompt does not (one engine: no routing)."""
    with gateway([real_replicas[0].url]) as one:

        def completion(tenant: str, prompt: str) -> int:
            with openai.OpenAI(base_url=f"{one.url}/v1", api_key=KEYS[tenant], max_retries=0, timeout=120) as client:
                answer = client.completions.create(model="tiny", prompt=prompt, max_tokens=2)
            assert answer.usage is not None and answer.usage.prompt_tokens_details is not None
            return answer.usage.prompt_tokens_details.cached_tokens or 0

        def response(tenant: str, instructions: str, question: str) -> int:
            with openai.OpenAI(base_url=f"{one.url}/v1", api_key=KEYS[tenant], max_retries=0, timeout=120) as client:
                answer = client.responses.create(
                    model="tiny", instructions=instructions, input=question, max_output_tokens=16
                )
            assert answer.usage is not None
            return answer.usage.input_tokens_details.cached_tokens or 0

        prompt = system("completions desk")
        assert completion("planner", prompt + " Lisbon?") == 0
        assert completion("planner", prompt + " Porto?") >= 3 * 128
        assert completion("articles", prompt + " Lisbon?") == 0
        instructions = system("responses desk")
        assert response("planner", instructions, "Lisbon?") == 0
        assert response("planner", instructions, "Porto?") >= 3 * 128
        assert response("articles", instructions, "Lisbon?") == 0
