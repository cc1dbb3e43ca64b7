"""The real OpenAI SDK against the gateway in front of real vLLM engines: the tiny chat model and
the tiny model as an embedding model. Responses (plain, streamed, previous_response_id, retrieve,
background refused), embeddings (one and a batch), tokenize/detokenize and the pooling endpoints, and the
gateway's own metrics for them."""

from __future__ import annotations

import time
from typing import Any

import httpx
import openai
import pytest

from server.deploy.plan import served_model
from server.gateway.settings import GatewaySettings
from tests.gateway.conftest import WORKER_COUNTS, WORKER_IDS, served_gateway

pytestmark = pytest.mark.engine

KEY = "sk-surface"
NO_EOS = {"ignore_eos": True}  # the tiny model's random weights may pick the end token early
POLL_DEADLINE_S = 120.0


@pytest.fixture(scope="module", params=WORKER_COUNTS, ids=WORKER_IDS)
def gateway_url(real_engine, real_embed_engine, request, tmp_path_factory):
    settings = GatewaySettings(auth={"api_keys_env": "TEST_SURFACE_KEYS"})
    models = [
        served_model(real_engine.model, [real_engine.url], real_engine.profile),
        served_model(real_embed_engine.model, [real_embed_engine.url], real_embed_engine.profile),
    ]
    log_dir = tmp_path_factory.mktemp("gateway")
    with served_gateway(settings, models, request.param, log_dir, environ={"TEST_SURFACE_KEYS": KEY}) as gw:
        yield gw.url


@pytest.fixture
def client(gateway_url):
    with openai.OpenAI(base_url=f"{gateway_url}/v1", api_key=KEY, max_retries=0, timeout=120) as client:
        yield client


@pytest.fixture
def root_client(gateway_url):
    """The SDK at the gateway's root, for vLLM's endpoints outside /v1 (/tokenize, /pooling, ...)."""
    with openai.OpenAI(base_url=gateway_url, api_key=KEY, max_retries=0, timeout=120) as client:
        yield client


def samples(gateway_url: str) -> dict[str, float]:
    text = httpx.get(f"{gateway_url}/metrics", timeout=10).text
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


def test_models_lists_both_engines(client, real_engine, real_embed_engine):
    assert {m.id for m in client.models.list().data} == {real_engine.model, real_embed_engine.model}


# -- Responses ------------------------------------------------------------------------------------


def test_responses_plain_then_previous_response_id_then_retrieve(client, real_engine, gateway_url):
    first = client.responses.create(
        model=real_engine.model, input="Plan a day in Lisbon.", max_output_tokens=4, extra_body=NO_EOS
    )
    assert first.object == "response" and first.usage is not None and first.usage.output_tokens == 4
    assert first.output_text  # four tokens of gibberish
    follow = client.responses.create(
        model=real_engine.model,
        input="And the evening?",
        max_output_tokens=4,
        previous_response_id=first.id,
        extra_body=NO_EOS,
    )
    assert follow.previous_response_id == first.id
    assert follow.usage is not None and follow.usage.input_tokens > first.usage.input_tokens  # the history came along
    again = client.responses.retrieve(first.id)
    assert again.id == first.id and again.output_text == first.output_text
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.retrieve("resp_0123456789abcdef")
    assert info.value.body["code"] == "response_not_found"


def test_responses_streamed_with_ttft_and_counts_by_endpoint(client, real_engine, gateway_url):
    before = samples(gateway_url)
    events = list(
        client.responses.create(
            model=real_engine.model, input="Plan a day.", max_output_tokens=5, stream=True, extra_body=NO_EOS
        )
    )
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    completed = events[-1].response
    assert deltas and "".join(deltas) == completed.output_text
    assert completed.usage is not None and completed.usage.output_tokens == 5
    ttft = 'gateway_endpoint_time_to_first_token_seconds_count{endpoint="responses"}'
    count = 'gateway_endpoint_requests_total{code="200",endpoint="responses"}'

    def settled() -> bool:
        after = samples(gateway_url)
        return after.get(count, 0) == before.get(count, 0) + 1

    deadline = time.monotonic() + POLL_DEADLINE_S
    while not settled():
        assert time.monotonic() < deadline, "the request was never counted"
        time.sleep(0.05)
    after = samples(gateway_url)
    assert after[ttft] == before.get(ttft, 0) + 1
    model_tokens = f'gateway_completion_tokens_total{{model="{real_engine.model}"}}'
    assert after[model_tokens] == before.get(model_tokens, 0) + 5  # from response.completed


def test_background_responses_are_refused_in_the_envelope(client, real_engine):
    with pytest.raises(openai.BadRequestError) as refused:  # the gateway stores answers; it runs none in the background
        client.responses.create(model=real_engine.model, input="Plan a week.", max_output_tokens=3, background=True)
    assert refused.value.body["param"] == "background" and refused.value.body["code"] == "unsupported_value"


# -- embeddings and the other endpoints ----------------------------------------------------------


def test_embeddings_one_and_a_batch(client, real_embed_engine):
    one = client.embeddings.create(model=real_embed_engine.model, input="a quiet place to read")
    assert len(one.data) == 1 and len(one.data[0].embedding) == 256  # the tiny model's hidden size
    assert one.usage.prompt_tokens > 0
    batch = client.embeddings.create(model=real_embed_engine.model, input=["museums", "food markets", "Sintra"])
    assert [d.index for d in batch.data] == [0, 1, 2]
    assert batch.usage.prompt_tokens > one.usage.prompt_tokens


def test_tokenize_and_detokenize_round_trip(root_client, real_engine, real_embed_engine):
    for model in (real_engine.model, real_embed_engine.model):
        tokens: Any = root_client.post("/tokenize", body={"model": model, "prompt": "Plan a trip"}, cast_to=object)
        assert tokens["count"] == len(tokens["tokens"]) > 0
        text: Any = root_client.post("/detokenize", body={"model": model, "tokens": tokens["tokens"]}, cast_to=object)
        assert text["prompt"] == "Plan a trip"


def test_pooling_endpoints_of_the_embedding_engine(root_client, real_embed_engine):
    pooled: Any = root_client.post(
        "/pooling", body={"model": real_embed_engine.model, "input": "hello"}, cast_to=object
    )
    assert pooled["data"] and pooled["usage"]["prompt_tokens"] > 0


def test_an_endpoint_the_engine_does_not_serve_is_the_sdks_not_found_error(client, real_engine, real_embed_engine):
    with pytest.raises(openai.NotFoundError) as info:  # a chat model serves no embeddings
        client.embeddings.create(model=real_engine.model, input="x")
    assert info.value.body["code"] == "not_found" and info.value.body["message"] == "Not Found"
    with pytest.raises(openai.NotFoundError):  # nor speech to text
        client.audio.transcriptions.create(model=real_engine.model, file=("a.wav", b"RIFF0000", "audio/wav"))
    with pytest.raises(openai.NotFoundError):  # an embedding model serves no Responses
        client.responses.create(model=real_embed_engine.model, input="x")
