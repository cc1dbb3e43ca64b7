"""LoRA on the real CPU engine, through the gateway: the tiny adapter is served, listed, routed only to
the replica that has it, changes the model's output, and runtime loads reach every replica.

Two replicas of `tiny`: the session's chat engine (no LoRA) and an engine of tiny-cpu-lora (the
tiny adapter `tiny-travel`, runtime updates on). Set TEST_LORA_ENGINE_URL to reuse a running one.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from server.deploy.plan import served_model
from server.gateway.settings import GatewaySettings
from tests.engine_process import running_engine
from tests.gateway.conftest import WORKER_COUNTS, WORKER_IDS, Gateway, served_gateway
from tests.support import wait_for

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[2]
ADMIN = "admin-lora"
GREEDY = {"temperature": 0, "ignore_eos": True}
POLL_DEADLINE_S = 120.0


@pytest.fixture(scope="module")
def lora_engine(tmp_path_factory):
    yield from running_engine(
        ROOT / "configs/profiles/tiny-cpu-lora.yaml", tmp_path_factory.mktemp("lora"), reuse_env="TEST_LORA_ENGINE_URL"
    )


@pytest.fixture(scope="module", params=WORKER_COUNTS, ids=WORKER_IDS)
def gateway(real_engine, lora_engine, request, tmp_path_factory):
    models = [served_model("tiny", [real_engine.url, lora_engine.url], lora_engine.profile)]
    # Each worker re-reads the engines' /v1/models at most every second (at each health check, 2 s).
    settings = GatewaySettings(health={"models_interval": 1.0})
    log_dir = tmp_path_factory.mktemp("gateway")
    with served_gateway(settings, models, request.param, log_dir, environ={"GATEWAY_ADMIN_KEYS": ADMIN}) as gw:
        yield gw


@pytest.fixture
def gateway_url(gateway):
    return gateway.url


def listed(gateway: Gateway, model: str) -> set[bool]:
    """Whether each worker lists `model` in its /v1/models: {True} when every one does."""
    answers = gateway.each_worker("GET", "/v1/models").values()
    return {model in [m["id"] for m in answer.json()["data"]] for answer in answers}


def test_the_adapter_is_listed_and_served_only_where_it_is(gateway_url):
    with openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
        listed = {m.id: (m.model_extra or {}).get("parent") for m in client.models.list().data}
        assert listed == {"tiny": None, "tiny-travel": "tiny"}
        # Least-outstanding would alternate between the two replicas; the one without the adapter
        # would answer 404. Every answer is the adapter's.
        texts = {
            client.completions.create(model="tiny-travel", prompt="Plan a day", max_tokens=6, extra_body=GREEDY)
            .choices[0]
            .text
            for _ in range(4)
        }
        base = client.completions.create(model="tiny", prompt="Plan a day", max_tokens=6, extra_body=GREEDY)
    assert len(texts) == 1 and base.choices[0].text not in texts  # greedy: one answer, not the base model's


def test_runtime_load_reaches_every_replica(gateway, lora_engine):
    gateway_url = gateway.url
    body = {"model": "tiny", "lora_name": "tiny-travel-runtime", "lora_path": str(ROOT / ".cache/tiny-lora")}
    answer = httpx.post(
        f"{gateway_url}/v1/load_lora_adapter", json=body, headers={"authorization": f"Bearer {ADMIN}"}, timeout=120
    )
    # The chat engine runs without LoRA: vLLM has no such endpoint there (404); the LoRA engine loads it.
    assert answer.status_code == 404, answer.text
    message = answer.json()["error"]["message"]
    assert "1 of 2 replicas" in message and "Success" in message
    # The worker that took the load routes it at once, every other one after its next /v1/models read.
    wait_for(lambda: listed(gateway, "tiny-travel-runtime") == {True}, timeout=POLL_DEADLINE_S)
    with openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
        for _ in range(3):  # routed to the replica that loaded it, and only there
            client.completions.create(model="tiny-travel-runtime", prompt="x", max_tokens=2)
    unload = httpx.post(
        f"{gateway_url}/v1/unload_lora_adapter",
        json={"model": "tiny", "lora_name": "tiny-travel-runtime"},
        headers={"authorization": f"Bearer {ADMIN}"},
        timeout=120,
    )
    assert unload.status_code == 404  # again: the chat engine has no endpoint for it
    wait_for(lambda: listed(gateway, "tiny-travel-runtime") == {False}, timeout=POLL_DEADLINE_S)
