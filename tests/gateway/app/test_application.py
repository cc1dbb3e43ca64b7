"""The gateway is a FastAPI app: its own routes, the proxied endpoints in /openapi.json, /docs, users' hooks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
from fastapi import FastAPI

from server.deploy.plan import plan_deployment
from server.gateway.app import create_app
from server.gateway.request.endpoints import ENDPOINTS
from tests.gateway.conftest import chat_body, fast_settings, sse_events
from tests.support import free_port, wait_for

ROOT = Path(__file__).resolve().parents[3]
HOOK = "tests.gateway.app.userhooks:setup"
OWN = {"/v1/models": "get", "/v1/models/{model}": "get", "/health": "get", "/ready": "get", "/metrics": "get"}


def _app(url: str = "http://127.0.0.1:9", **overrides) -> FastAPI:
    settings = fast_settings({"standin": [url]}, **overrides)
    return create_app(settings, plan_deployment(settings.models).served_models())


def test_create_app_returns_a_fastapi_app():
    app = _app()
    assert isinstance(app, FastAPI)
    assert {route.path_format for route in app.routes} >= set(OWN) | {e.path for e in ENDPOINTS}  # type: ignore[attr-defined]


def test_openapi_lists_the_gateways_own_endpoints_and_every_proxied_one():
    schema = _app().openapi()
    paths = schema["paths"]
    for path, method in OWN.items():
        assert method in paths[path], path
    for endpoint in ENDPOINTS:
        assert endpoint.method.lower() in paths[endpoint.path], (endpoint.method, endpoint.path)
    chat = paths["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    chat_schema = schema["components"]["schemas"][chat["$ref"].rsplit("/", 1)[1]]
    assert {"model", "messages"} <= set(chat_schema["required"])
    assert paths["/v1/responses/{response_id}"]["get"]["parameters"][0]["name"] == "response_id"
    operation_ids = [op["operationId"] for item in paths.values() for op in item.values()]
    assert len(operation_ids) == len(set(operation_ids))


def test_openapi_and_docs_are_served_without_a_cdn(engines, gateway):
    (engine,) = engines(1)
    gw = gateway(fast_settings({"standin": [engine.url]}))
    spec = httpx.get(f"{gw.url}/openapi.json", timeout=30)
    assert spec.status_code == 200
    assert "/v1/chat/completions" in spec.json()["paths"]
    docs = httpx.get(f"{gw.url}/docs", timeout=30)
    assert docs.status_code == 200 and "text/html" in docs.headers["content-type"]
    assert "cdn" not in docs.text.lower() and "/docs/assets/swagger-ui-bundle.js" in docs.text
    bundle = httpx.get(f"{gw.url}/docs/assets/swagger-ui-bundle.js", timeout=30)
    assert bundle.status_code == 200 and "javascript" in bundle.headers["content-type"]
    assert b"SwaggerUIBundle" in bundle.content
    missing = httpx.get(f"{gw.url}/docs/assets/../../etc/passwd", timeout=30)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"


def test_a_users_route_dependency_and_middleware_work_beside_streaming(engines, gateway):
    """Through settings.app_hooks: every worker process calls the hook on its own app."""
    (engine,) = engines(1)
    gw = gateway(fast_settings({"standin": [engine.url]}, app_hooks=[HOOK]))
    mine = httpx.get(f"{gw.url}/v1/whoami", headers={"x-team": "planner"}, timeout=30)
    assert mine.status_code == 200 and mine.json() == {"team": "planner"}
    assert mine.headers["x-user-middleware"] == "seen"
    refused = httpx.get(f"{gw.url}/v1/whoami", timeout=30)  # the user's own dependency refuses
    assert refused.status_code == 400 and refused.json()["error"]["message"] == "send x-team"
    with httpx.stream("POST", f"{gw.url}/v1/chat/completions", json=chat_body(stream=True), timeout=60) as response:
        text = "".join(response.iter_text())
    assert response.status_code == 200 and response.headers["x-user-middleware"] == "seen"
    events = sse_events(text)
    assert events[-1] == "[DONE]" and len(events) > 3
    whole = httpx.post(f"{gw.url}/v1/chat/completions", json=chat_body(), timeout=60)
    assert whole.status_code == 200 and whole.headers["x-user-middleware"] == "seen"
    assert whole.json()["choices"][0]["message"]["content"]
    unknown = httpx.get(f"{gw.url}/v1/nothing-here", timeout=30)
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "not_found"
    assert "x-request-id" in unknown.headers


def test_the_cli_serves_a_users_hook_with_the_openai_sdk_streaming(engines, tmp_path):
    """`python -m server serve --app-hook module:function`, as the README shows it."""
    (engine,) = engines(1)
    port = free_port()
    log = tmp_path / "gateway.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-m", "server", "serve", "--upstream", f"standin={engine.url}", "--port", str(port)]
    with log.open("wb") as out:
        process = subprocess.Popen([*argv, "--app-hook", HOOK], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:

        def ready() -> bool:
            assert process.poll() is None, log.read_text()
            try:
                return httpx.get(f"{url}/ready", timeout=5).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(ready, timeout=120, what=lambda: log.read_text()[-2000:])
        assert httpx.get(f"{url}/v1/whoami", headers={"x-team": "t"}, timeout=30).json() == {"team": "t"}
        with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client:
            raw = client.chat.completions.with_raw_response.create(
                model="standin", messages=[{"role": "user", "content": "hi"}], stream=True
            )
            assert raw.headers["x-user-middleware"] == "seen"
            chunks = list(raw.parse())
        assert any(c.choices and c.choices[0].delta.content for c in chunks)
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(timeout=60)
    assert process.returncode == 0, log.read_text()[-2000:]


def test_a_hook_that_cannot_be_imported_is_refused_at_start(tmp_path):
    argv = [sys.executable, "-m", "server", "serve", "--upstream", "m=http://127.0.0.1:9", "--app-hook", "nope:setup"]
    result = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "app_hooks: 'nope:setup': cannot import nope" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("path", ["/health", "/ready", "/metrics", "/v1/models"])
def test_the_gateways_own_routes_answer_head_without_a_body(engines, gateway, path):
    (engine,) = engines(1)
    gw = gateway(fast_settings({"standin": [engine.url]}))
    response = httpx.head(f"{gw.url}{path}", timeout=30)
    assert response.status_code == 200 and response.content == b""
    assert "x-request-id" in response.headers


def test_openapi_lists_what_only_the_response_store_and_the_admin_api_answer():
    app = _app(tenants=[{"name": "planner", "api_keys": ["sk-planner-0123456789abcdef"]}])
    paths = app.openapi()["paths"]
    for method, path in (
        ("delete", "/v1/responses/{response_id}"),
        ("get", "/v1/responses/{response_id}/input_items"),
        ("get", "/v1/responses/{response_id}"),  # the endpoint table's, kept beside DELETE
        ("get", "/admin/usage"),
    ):
        assert method in paths[path], (method, path)
    # every method and path the response store answers is described (app.responses' own table)
    assert app.responses is not None
    for path, item in paths.items():
        for method in item:
            if path.startswith("/v1/responses/{response_id}"):
                concrete = path.replace("{response_id}", "resp_x")
                assert app.responses.route(concrete, method.upper()) is not None, (method, path)
    for concrete, method in (("/v1/responses/resp_x", "DELETE"), ("/v1/responses/resp_x/input_items", "GET")):
        assert app.responses.route(concrete, method) is not None
