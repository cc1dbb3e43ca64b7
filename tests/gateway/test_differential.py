"""Gateway vs engine, side by side: for each endpoint and a table of valid and invalid requests, the
gateway's answer has the engine's status and the same JSON shape (keys and value types, all the way
down; the values themselves are the model's and differ from run to run).

The designed differences: an engine error that is not in the OpenAI envelope (FastAPI's
`{"detail": "Not Found"}` for an endpoint the engine does not serve) reaches the client in the
envelope, with the engine's status and message; and an error's `code` may be vLLM's number (404)
or the gateway's string (`response_not_found`, for a response id no engine of the gateway made,
which the gateway answers itself). Requests go to the engines directly without a key
(vLLM runs without one here) and to the gateway with its key.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from server.deploy.plan import served_model
from server.gateway.settings import GatewaySettings
from tests.gateway.conftest import WORKER_COUNTS, WORKER_IDS, served_gateway

pytestmark = pytest.mark.engine

KEY = "sk-differential"
CHAT = "chat"  # rows for the tiny chat engine
EMBED = "embed"  # rows for the tiny embedding engine
USER = [{"role": "user", "content": "Plan a day."}]
ENVELOPE_SHAPE = {"error": {"message": "str", "type": "str", "param": "null", "code": "str"}}


@dataclass(frozen=True)
class Row:
    name: str
    engine: str  # CHAT or EMBED
    path: str
    body: dict[str, Any] | None = None  # JSON; None: see `form`, or no body (GET)
    method: str = "POST"
    form: dict[str, str] = field(default_factory=dict)  # multipart fields, with one small file


def rows(chat: str, embed: str) -> list[Row]:
    """The table; `chat`, `embed`: the engines' served model names."""
    return [
        Row("chat", CHAT, "/v1/chat/completions", {"model": chat, "messages": USER, "max_tokens": 3}),
        Row("chat, max_tokens < 0", CHAT, "/v1/chat/completions", {"model": chat, "messages": USER, "max_tokens": -1}),
        Row(
            "chat, temperature a string",
            CHAT,
            "/v1/chat/completions",
            {"model": chat, "messages": USER, "temperature": "hot"},
        ),
        Row("completions", CHAT, "/v1/completions", {"model": chat, "prompt": "Once", "max_tokens": 3}),
        Row("completions, n = 0", CHAT, "/v1/completions", {"model": chat, "prompt": "Once", "n": 0}),
        Row("responses", CHAT, "/v1/responses", {"model": chat, "input": "Plan a day.", "max_output_tokens": 3}),
        Row(
            "responses, input messages",
            CHAT,
            "/v1/responses",
            {"model": chat, "input": USER, "max_output_tokens": 3, "instructions": "Be brief."},
        ),
        Row(
            "responses, max_output_tokens a string",
            CHAT,
            "/v1/responses",
            {"model": chat, "input": "x", "max_output_tokens": "many"},
        ),
        Row(
            "responses, unknown previous_response_id",
            CHAT,
            "/v1/responses",
            {"model": chat, "input": "x", "previous_response_id": "resp_0123456789abcdef"},
        ),
        Row("responses retrieve, unknown id", CHAT, "/v1/responses/resp_0123456789abcdef", method="GET"),
        Row("responses cancel, unknown id", CHAT, "/v1/responses/resp_0123456789abcdef/cancel", {}),
        Row("messages (Anthropic)", CHAT, "/v1/messages", {"model": chat, "max_tokens": 3, "messages": USER}),
        Row("messages count_tokens", CHAT, "/v1/messages/count_tokens", {"model": chat, "messages": USER}),
        Row("tokenize a prompt", CHAT, "/tokenize", {"model": chat, "prompt": "Plan a trip"}),
        Row("tokenize messages", CHAT, "/tokenize", {"model": chat, "messages": USER}),
        Row("tokenize, prompt a number", CHAT, "/tokenize", {"model": chat, "prompt": 42}),
        Row("detokenize", CHAT, "/detokenize", {"model": chat, "tokens": [5, 6, 7]}),
        Row("detokenize, tokens a string", CHAT, "/detokenize", {"model": chat, "tokens": "five"}),
        Row("embeddings on a chat engine", CHAT, "/v1/embeddings", {"model": chat, "input": "x"}),
        Row("rerank on a chat engine", CHAT, "/v1/rerank", {"model": chat, "query": "q", "documents": ["d"]}),
        Row("transcriptions on a chat engine", CHAT, "/v1/audio/transcriptions", form={"model": chat}),
        Row("embeddings", EMBED, "/v1/embeddings", {"model": embed, "input": "a quiet place"}),
        Row("embeddings, a batch", EMBED, "/v1/embeddings", {"model": embed, "input": ["a", "b", "c"]}),
        Row("embeddings, token ids", EMBED, "/v1/embeddings", {"model": embed, "input": [[5, 6, 7]]}),
        Row("embeddings, input an object", EMBED, "/v1/embeddings", {"model": embed, "input": {"text": "x"}}),
        Row("embeddings, base64", EMBED, "/v1/embeddings", {"model": embed, "input": "x", "encoding_format": "base64"}),
        Row("embed (Cohere v2)", EMBED, "/v2/embed", {"model": embed, "texts": ["x"], "input_type": "search_query"}),
        Row("pooling", EMBED, "/pooling", {"model": embed, "input": "x"}),
        Row("classify on an embedding engine", EMBED, "/classify", {"model": embed, "input": "x"}),
        Row("score", EMBED, "/score", {"model": embed, "queries": "a", "documents": ["b", "c"]}),
        Row("score (v1)", EMBED, "/v1/score", {"model": embed, "queries": "a", "documents": "b"}),
        Row("rerank", EMBED, "/rerank", {"model": embed, "query": "a", "documents": ["b", "c"]}),
        Row("rerank (v1)", EMBED, "/v1/rerank", {"model": embed, "query": "a", "documents": ["b"], "top_n": 1}),
        Row("rerank (v2)", EMBED, "/v2/rerank", {"model": embed, "query": "a", "documents": ["b"]}),
        Row("rerank, documents missing", EMBED, "/v1/rerank", {"model": embed, "query": "a"}),
        Row("tokenize on the embedding engine", EMBED, "/tokenize", {"model": embed, "prompt": "x"}),
        Row("chat on an embedding engine", EMBED, "/v1/chat/completions", {"model": embed, "messages": USER}),
        Row("responses on an embedding engine", EMBED, "/v1/responses", {"model": embed, "input": "x"}),
    ]


def shape(value: Any) -> Any:
    """The structure of a JSON value: dicts keep their keys, lists the shape of their first item."""
    if isinstance(value, dict):
        return {key: shape(item) for key, item in value.items()}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    return "null" if value is None else "str"


def envelope_shape(payload: Any) -> Any:
    """What the gateway makes of an engine's error body: itself when it is an envelope, else one."""
    if isinstance(payload, dict) and isinstance(payload.get("error"), dict):
        return error_shape(payload)
    return error_shape(ENVELOPE_SHAPE)


def error_shape(payload: Any) -> Any:
    """An error envelope's shape, its `code` either a number (vLLM) or a string (the gateway)."""
    out = shape(payload) if payload is not ENVELOPE_SHAPE else {"error": dict(ENVELOPE_SHAPE["error"])}
    if isinstance(out.get("error"), dict) and "code" in out["error"]:
        out["error"]["code"] = "code"
    return out


def send(client: httpx.Client, base: str, row: Row, headers: dict[str, str]) -> httpx.Response:
    if row.form:
        files = {"file": ("clip.wav", b"RIFF" + bytes(64), "audio/wav")}
        return client.post(base + row.path, data=row.form, files=files, headers=headers)
    if row.body is None:
        return client.request(row.method, base + row.path, headers=headers)
    return client.request(row.method, base + row.path, json=row.body, headers=headers)


@pytest.fixture(scope="module", params=WORKER_COUNTS, ids=WORKER_IDS)
def gateway_url(real_engine, real_embed_engine, request, tmp_path_factory):
    settings = GatewaySettings(auth={"api_keys_env": "TEST_DIFFERENTIAL_KEYS"})
    models = [
        served_model(real_engine.model, [real_engine.url], real_engine.profile),
        served_model(real_embed_engine.model, [real_embed_engine.url], real_embed_engine.profile),
    ]
    log_dir = tmp_path_factory.mktemp("gateway")
    with served_gateway(settings, models, request.param, log_dir, environ={"TEST_DIFFERENTIAL_KEYS": KEY}) as gw:
        yield gw.url


def test_the_gateway_answers_like_the_engine(gateway_url, real_engine, real_embed_engine):
    engines = {CHAT: real_engine.url, EMBED: real_embed_engine.url}
    mismatches: list[str] = []
    statuses: dict[str, int] = {}
    with httpx.Client(timeout=120) as client:
        for row in rows(real_engine.model, real_embed_engine.model):
            direct = send(client, engines[row.engine], row, {})
            through = send(client, gateway_url, row, {"authorization": f"Bearer {KEY}"})
            statuses[row.name] = direct.status_code
            expected = shape(direct.json()) if direct.status_code < 400 else envelope_shape(direct.json())
            got = shape(through.json()) if through.status_code < 400 else error_shape(through.json())
            if through.status_code != direct.status_code or got != expected:
                mismatches.append(
                    f"{row.name}: engine {direct.status_code} {json.dumps(expected)[:300]}\n"
                    f"    gateway {through.status_code} {json.dumps(got)[:300]}"
                )
    assert not mismatches, "\n".join(mismatches)
    # The table is worth something only if it has both kinds of answer, from both engines.
    assert any(s == 200 for s in statuses.values()) and any(400 <= s < 500 for s in statuses.values())
    assert statuses["embeddings"] == 200 and statuses["embeddings on a chat engine"] == 404


def test_streams_have_the_engines_events(gateway_url, real_engine):
    """Streamed chat and Responses: the same event kinds in the same order (the tokens differ, and so
    may the number of delta events: bytes of an unfinished UTF-8 character wait for the next token)."""

    def kinds(text: str) -> list[str]:
        out: list[str] = []
        for block in text.split("\n\n"):
            data = [line[6:] for line in block.splitlines() if line.startswith("data: ")]
            if data:
                payload = data[0]
                kind = (
                    payload
                    if payload == "[DONE]"
                    else (json.loads(payload).get("type") or json.loads(payload).get("object"))
                )
                if not out or out[-1] != kind:  # runs of one kind count once
                    out.append(kind)
        return out

    cases = [
        (
            "/v1/chat/completions",
            {
                "model": real_engine.model,
                "messages": USER,
                "max_tokens": 4,
                "stream": True,
                "ignore_eos": True,
                "stream_options": {"include_usage": True},
            },
        ),
        (
            "/v1/responses",
            {"model": real_engine.model, "input": "x", "max_output_tokens": 4, "stream": True, "ignore_eos": True},
        ),
    ]
    with httpx.Client(timeout=120) as client:
        for path, body in cases:
            direct = client.post(real_engine.url + path, json=body)
            through = client.post(gateway_url + path, json=body, headers={"authorization": f"Bearer {KEY}"})
            assert (through.status_code, through.headers["content-type"]) == (
                direct.status_code,
                direct.headers["content-type"],
            )
            assert kinds(through.text) == kinds(direct.text), path
            assert shape(last_event(through.text)) == shape(last_event(direct.text)), path


def last_event(text: str) -> Any:
    """The payload of the last event before `[DONE]` (chat: the usage chunk; Responses: response.completed)."""
    payloads = [line[6:] for line in text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]
    return json.loads(payloads[-1])
