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
from prometheus_client import CollectorRegistry

from server.config import ServedModel
from server.gateway.app import create_app
from server.gateway.settings import GatewaySettings
from tests.engine_process import running_engine
from tests.support import serve_in_thread

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[2]
ADMIN = "admin-lora"
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def lora_engine(tmp_path_factory):
    yield from running_engine(
        ROOT / "configs/profiles/tiny-cpu-lora.yaml", tmp_path_factory.mktemp("lora"), reuse_env="TEST_LORA_ENGINE_URL"
    )


@pytest.fixture(scope="module")
def gateway_url(real_engine, lora_engine):
    models = [ServedModel("tiny", [real_engine.url, lora_engine.url], lora_engine.profile)]
    app = create_app(GatewaySettings(), models, registry=CollectorRegistry(), environ={"GATEWAY_ADMIN_KEYS": ADMIN})
    with serve_in_thread(app) as url:
        yield url


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


def test_runtime_load_reaches_every_replica(gateway_url, lora_engine):
    body = {"model": "tiny", "lora_name": "tiny-travel-runtime", "lora_path": str(ROOT / ".cache/tiny-lora")}
    answer = httpx.post(
        f"{gateway_url}/v1/load_lora_adapter", json=body, headers={"authorization": f"Bearer {ADMIN}"}, timeout=120
    )
    # The chat engine runs without LoRA: vLLM has no such endpoint there (404); the LoRA engine loads it.
    assert answer.status_code == 404, answer.text
    message = answer.json()["error"]["message"]
    assert "1 of 2 replicas" in message and "Success" in message
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
    models = httpx.get(f"{gateway_url}/v1/models", timeout=10).json()["data"]
    assert "tiny-travel-runtime" not in [m["id"] for m in models]
