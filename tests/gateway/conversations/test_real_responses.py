"""The gateway answers the Responses API's stored state itself, with the real OpenAI SDK against
the session's real vLLM engine: continuations by id, retrieve, input items, delete, streamed and
whole answers recorded, another tenant's id answered 404 as if absent, a client that leaves
mid-stream leaving an `incomplete` record, and the engine sent stateless requests only."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from server.deploy.plan import served_model
from server.gateway.settings import GatewaySettings
from tests.gateway.conftest import Gateway, served_gateway

pytestmark = pytest.mark.engine

PLANNER, ARTICLES = "sk-planner-conv", "sk-articles-conv"
NO_EOS = {"ignore_eos": True}  # the tiny model's random weights may pick the end token early
POLL_DEADLINE_S = 120.0


def settings_for(store: Path, **extra: object) -> GatewaySettings:
    return GatewaySettings.model_validate(
        {
            "tenants": [{"name": "planner", "api_keys": [PLANNER]}, {"name": "articles", "api_keys": [ARTICLES]}],
            "responses_store": {"backend": "sqlite", "path": str(store)},
            **extra,
        }
    )


@pytest.fixture(scope="module")
def gateway(real_engine, tmp_path_factory) -> Iterator[Gateway]:
    folder = tmp_path_factory.mktemp("responses")
    models = [served_model(real_engine.model, [real_engine.url], real_engine.profile)]
    with served_gateway(settings_for(folder / "responses.sqlite3"), models, 1, folder) as gw:
        yield gw


def sdk(gateway: Gateway, key: str = PLANNER) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0, timeout=120)


def test_a_conversation_continued_by_id_is_served_from_the_gateways_store(gateway, real_engine):
    with sdk(gateway) as client:
        first = client.responses.create(
            model=real_engine.model, input="Plan a day in Lisbon.", max_output_tokens=4, extra_body=NO_EOS
        )
        assert first.usage is not None and first.usage.output_tokens == 4
        follow = client.responses.create(
            model=real_engine.model,
            input=[{"role": "user", "content": "And the evening?"}],
            instructions="Answer briefly.",
            previous_response_id=first.id,
            max_output_tokens=4,
            extra_body=NO_EOS,
        )
        assert follow.previous_response_id == first.id and follow.instructions == "Answer briefly."
        assert follow.usage is not None and follow.usage.input_tokens > first.usage.input_tokens  # the history came
        again = client.responses.retrieve(first.id)
        assert again.model_dump() == first.model_dump()  # what the client was answered, field for field
        items = client.responses.input_items.list(follow.id, order="asc").data
        assert [(i.role, i.content) for i in items] == [("user", "And the evening?")]
        first_items = client.responses.input_items.list(first.id).data
        assert [(i.role, [c.text for c in i.content]) for i in first_items] == [("user", ["Plan a day in Lisbon."])]
    # The engine was sent stateless requests: it holds neither response.
    for rid in (first.id, follow.id):
        assert httpx.get(f"{real_engine.openai_base_url}/responses/{rid}", timeout=30).status_code == 404


def test_a_streamed_answer_is_recorded_as_the_client_saw_it(gateway, real_engine):
    with sdk(gateway) as client:
        events = list(
            client.responses.create(
                model=real_engine.model, input="Plan a week.", max_output_tokens=5, stream=True, extra_body=NO_EOS
            )
        )
        assert [events[0].type, events[-1].type] == ["response.created", "response.completed"]
        completed = events[-1].response
        stored = client.responses.retrieve(completed.id)
        assert stored.model_dump() == completed.model_dump()
        assert stored.output_text == "".join(e.delta for e in events if e.type == "response.output_text.delta")
        follow = client.responses.create(
            model=real_engine.model, input="More?", previous_response_id=completed.id, max_output_tokens=2
        )
        assert follow.previous_response_id == completed.id


def test_store_false_is_not_kept(gateway, real_engine):
    with sdk(gateway) as client:
        answer = client.responses.create(model=real_engine.model, input="x", max_output_tokens=1, store=False)
        with pytest.raises(openai.NotFoundError) as info:
            client.responses.retrieve(answer.id)
        assert info.value.body["code"] == "response_not_found"


def test_another_tenants_response_is_absent(gateway, real_engine):
    with sdk(gateway) as planner, sdk(gateway, ARTICLES) as articles:
        mine = planner.responses.create(model=real_engine.model, input="secret trip", max_output_tokens=2)
        for attempt in (
            lambda: articles.responses.retrieve(mine.id),
            lambda: articles.responses.input_items.list(mine.id),
            lambda: articles.responses.delete(mine.id),
            lambda: articles.responses.cancel(mine.id),
            lambda: articles.responses.create(
                model=real_engine.model, input="more", previous_response_id=mine.id, max_output_tokens=1
            ),
        ):
            with pytest.raises(openai.NotFoundError) as info:
                attempt()
            assert info.value.body["code"] == "response_not_found"
            assert info.value.body["message"] == f"Response with id '{mine.id}' not found."  # as if it never was
        with pytest.raises(openai.NotFoundError) as never:
            articles.responses.retrieve("resp_" + "0" * 32)
        assert never.value.body["message"] == f"Response with id 'resp_{'0' * 32}' not found."
        assert planner.responses.retrieve(mine.id).id == mine.id
        planner.responses.delete(mine.id)
        with pytest.raises(openai.NotFoundError):
            planner.responses.retrieve(mine.id)


def test_cancel_of_a_finished_response_is_refused_and_background_is_refused(gateway, real_engine):
    with sdk(gateway) as client:
        done = client.responses.create(model=real_engine.model, input="x", max_output_tokens=1)
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.cancel(done.id)
        assert refused.value.body["code"] == "not_cancellable"
        with pytest.raises(openai.BadRequestError) as background:
            client.responses.create(model=real_engine.model, input="x", background=True)
        assert background.value.body["param"] == "background"


def test_a_client_that_leaves_mid_stream_leaves_an_incomplete_record(gateway, real_engine):
    body = {
        "model": real_engine.model,
        "input": "Write a long story.",
        "max_output_tokens": 1500,
        "stream": True,
        "ignore_eos": True,
    }
    headers = {"authorization": f"Bearer {PLANNER}"}
    response_id = None
    with (
        httpx.Client(timeout=120) as client,
        client.stream("POST", f"{gateway.url}/v1/responses", json=body, headers=headers) as stream,
    ):
        for line in stream.iter_lines():
            if line.startswith("data:") and '"response.created"' in line:
                response_id = httpx.Response(200, content=line[5:]).json()["response"]["id"]
            if '"response.output_text.delta"' in line:
                break  # leave with the answer under way
    assert response_id is not None
    with sdk(gateway) as sdk_client:
        deadline = time.monotonic() + POLL_DEADLINE_S
        while True:
            try:
                stored = sdk_client.responses.retrieve(response_id)
                break
            except openai.NotFoundError:
                assert time.monotonic() < deadline, "the cut stream was never recorded"
                time.sleep(0.1)
        assert stored.status == "incomplete"
        assert stored.incomplete_details is not None and stored.incomplete_details.reason == "interrupted"
        items = sdk_client.responses.input_items.list(response_id).data
        assert [i.content[0].text for i in items] == ["Write a long story."]
