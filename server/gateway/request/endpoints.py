"""The table of proxied endpoints: adding one is one entry here.

Each entry says where the endpoint lives (method and path, the same on the gateway and on the
engine; `{response_id}` marks a path parameter), how the gateway finds the model a request is
for (`model_from`), whether it may answer as a stream and in which SSE dialect (`stream_format`),
which body checks the gateway makes before routing (the engine validates the rest and its own
errors pass through), and whether history trimming applies. The router serves every entry
through the same steps (request id, auth, body read once and bounded, checks, trimming, proxy),
so a new endpoint gets auth, request ids, timeouts, retries, disconnect aborts, the error
envelope and metrics without more code.

    model_from     the model is ...                                  entries
    json           the body's `model` field                          most
    form           the `model` field of a multipart/urlencoded form  audio (body limit: max_upload_bytes)
    response_id    none: answered by the gateway's store             retrieve, cancel of a response

Responses: the gateway keeps stored responses itself (app.responses, server.gateway.conversations):
a create reaches the proxy stateless (`store: false`, the whole input, a `request_id` the gateway
chose), and the retrieve and cancel entries are answered from the store before the proxy.
`fan_out` entries (runtime LoRA) go to every replica of the model, behind the admin key.
The paths are vLLM 0.32's (vllm/entrypoints/**/api_router.py, registered by
vllm/entrypoints/launchers/api_server/routers.py); an engine that does not serve one (a chat
model asked for embeddings) answers 404, which the client gets in the OpenAI error envelope.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from server.gateway.http.streams import ANTHROPIC, CHAT, RESPONSES, StreamFormat
from server.gateway.request.checks import check_messages, check_prompt

BodyCheck = Callable[[dict[str, Any]], None]
ModelSource = Literal["json", "form", "response_id"]
PARAM = "{response_id}"


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One OpenAI-compatible endpoint the gateway forwards to an engine."""

    name: str  # metrics label and log field
    path: str  # the same path on the gateway and on the engine; `{response_id}` is a path parameter
    check: BodyCheck | None = None  # raises InvalidRequest for a body the gateway cannot route
    streams: bool = True  # `"stream": true` (a form field `stream=true`, a query `?stream=true`) answers with SSE
    trims_history: bool = False  # history trimming may shorten `messages` (chat) or `input` (Responses)
    method: str = "POST"
    model_from: ModelSource = "json"
    stream_format: StreamFormat = CHAT
    stores_responses: bool = False  # Responses create (its state is the gateway's: app.responses)
    fan_out: bool = False  # sent to every replica of the model; needs the admin key
    usage_option: bool = False  # takes `stream_options.include_usage` (the proxy always asks: proxy.hidden_usage)

    @property
    def prefix(self) -> str:
        """The path before `{response_id}` (the whole path when it has no parameter)."""
        return self.path.partition(PARAM)[0]

    @property
    def suffix(self) -> str:
        return self.path.partition(PARAM)[2]


def _json(name: str, path: str, **options: Any) -> Endpoint:
    """A non-streaming JSON endpoint routed by its `model` field."""
    return Endpoint(name, path, streams=False, **options)


ENDPOINTS: tuple[Endpoint, ...] = (
    # Generation (engines of a `generate` model).
    Endpoint("chat", "/v1/chat/completions", check=check_messages, trims_history=True, usage_option=True),
    Endpoint("completions", "/v1/completions", check=check_prompt, usage_option=True),
    _json("chat_batch", "/v1/chat/completions/batch"),
    Endpoint("responses", "/v1/responses", stream_format=RESPONSES, stores_responses=True, trims_history=True),
    Endpoint(
        "responses_retrieve",
        "/v1/responses/{response_id}",
        method="GET",
        model_from="response_id",
        stream_format=RESPONSES,
    ),
    _json("responses_cancel", "/v1/responses/{response_id}/cancel", model_from="response_id"),
    Endpoint("messages", "/v1/messages", stream_format=ANTHROPIC),  # Anthropic's Messages API
    _json("messages_count_tokens", "/v1/messages/count_tokens"),
    _json("generative_scoring", "/generative_scoring"),
    # Any engine: its tokenizer.
    _json("tokenize", "/tokenize"),
    _json("detokenize", "/detokenize"),
    # Pooling (engines started with `--runner pooling`): vLLM's paths and aliases.
    _json("embeddings", "/v1/embeddings"),
    _json("embed_v2", "/v2/embed"),  # Cohere's embed API
    _json("pooling", "/pooling"),
    _json("classify", "/classify"),
    _json("score", "/score"),
    _json("score", "/v1/score"),
    _json("rerank", "/rerank"),
    _json("rerank", "/v1/rerank"),
    _json("rerank", "/v2/rerank"),
    # Speech to text (ASR models): multipart uploads.
    Endpoint("transcriptions", "/v1/audio/transcriptions", model_from="form"),
    Endpoint("translations", "/v1/audio/translations", model_from="form"),
    # Runtime LoRA adapters (engines with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1), every replica at once.
    _json("load_lora_adapter", "/v1/load_lora_adapter", fan_out=True),
    _json("unload_lora_adapter", "/v1/unload_lora_adapter", fan_out=True),
)

# POSTs to fixed paths: one dict lookup on the hot path.
BY_PATH: dict[str, Endpoint] = {e.path: e for e in ENDPOINTS if PARAM not in e.path and e.method == "POST"}
BY_NAME: dict[str, Endpoint] = {e.name: e for e in ENDPOINTS}
# Everything else: a path parameter, or a method other than POST.
OTHERS: tuple[Endpoint, ...] = tuple(e for e in ENDPOINTS if PARAM in e.path or e.method != "POST")


def match(path: str, method: str, endpoints: tuple[Endpoint, ...] = OTHERS) -> tuple[Endpoint, str] | None:
    """The entry of `OTHERS` for `method path`, and its path parameter ("" without one); or None."""
    for endpoint in endpoints:
        if endpoint.method != method:
            continue
        prefix, suffix = endpoint.prefix, endpoint.suffix
        if PARAM not in endpoint.path:
            if path == endpoint.path:
                return endpoint, ""
            continue
        if path.startswith(prefix) and path.endswith(suffix) and len(path) > len(prefix) + len(suffix):
            value = path[len(prefix) : len(path) - len(suffix)]
            if "/" not in value:
                return endpoint, value
    return None


def known_path(path: str) -> bool:
    """Some entry serves `path` (with another method): the answer is 405, not 404."""
    return path in BY_PATH or any(match(path, e.method, (e,)) for e in OTHERS)
