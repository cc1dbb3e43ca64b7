"""A real Prometheus scrapes the real gateway in front of the real vLLM engine while requests run;
then every query of every dashboard panel and every alert expression must return data."""

from __future__ import annotations

import math
import re
import time

import openai
import pytest
from prometheus_client import CollectorRegistry

from server.deploy.plan import served_model
from server.gateway.app import create_app
from server.gateway.settings import GatewaySettings
from tests.metrics.prometheus_server import run_prometheus
from tests.metrics.test_dashboards_and_alerts import ALERTS, alert_exprs, dashboard_queries
from tests.support import serve_in_thread

pytestmark = [pytest.mark.prometheus, pytest.mark.engine]

# Series this test's traffic cannot create, each with why and where it is checked instead.
NO_DATA_HERE = {
    "gateway_flow_shed_total": "a shed needs full engines and a queue past its bounds "
    "(tests/gateway/flow/test_gateway.py sheds on stand-in engines and reads the metric)",
}
PLANNER_KEY = "sk-dashboard-planner"
LIMITED_KEY = "sk-dashboard-limited"
COMPARISON = re.compile(r"\s*(==|!=|>=|<=|>|<)\s*[-+0-9.eE]+\s*$")


def grafana_expr(expr: str, window_s: float) -> str:
    """`expr` with Grafana's variables filled in as Grafana would: all models and tenants, and a rate
    window of `window_s` (the test's whole traffic, so a slow machine cannot push a request out of it)."""
    variables = {"$model": ".*", "$tenant": ".*", "$__rate_interval": f"{math.ceil(window_s)}s"}
    for name, value in variables.items():
        expr = expr.replace(name, value)
    assert "$" not in expr, f"unfilled variable in {expr}"
    return expr


def without_threshold(expr: str) -> str:
    """`X > 0.9` -> `X`: the series an alert compares, which must exist even when all is well."""
    stripped = COMPARISON.sub("", expr.strip())
    assert stripped != expr.strip(), f"alert expression without a final threshold: {expr}"
    return stripped


def total(result: list[dict]) -> float:
    return sum(float(r["value"][1]) for r in result)


def test_every_dashboard_query_and_alert_expression_returns_data(real_engine):
    model = real_engine.model
    # Two tenants, so the Tenants and Flow control rows have data: the traffic below is the planner's,
    # and `limited` is refused once (the 429 panel).
    settings = GatewaySettings.model_validate(
        {
            "metrics_scrape_interval": 0.5,
            "tenants": [
                {"name": "planner", "api_keys": [PLANNER_KEY], "priority": "interactive"},
                {"name": "limited", "api_keys": [LIMITED_KEY], "limits": {"requests_per_minute": 1}},
            ],
        }
    )
    # The profile's plan gives gateway_engine_kv_cache_planned_tokens; the URL is the engine.
    models = [served_model(model, [real_engine.url], real_engine.profile)]
    app = create_app(settings, models, registry=CollectorRegistry())
    with (
        serve_in_thread(app) as gateway,
        run_prometheus(gateway, rule_files=[ALERTS]) as prom,
        openai.OpenAI(base_url=gateway + "/v1", api_key=PLANNER_KEY, max_retries=0, timeout=60) as client,
        openai.OpenAI(base_url=gateway + "/v1", api_key=LIMITED_KEY, max_retries=0, timeout=60) as limited,
    ):
        started = time.monotonic()

        def send(stream: bool, i: int) -> None:
            request = dict(
                model=model,
                messages=[{"role": "user", "content": f"Tell me about trains, part {i}."}],
                # Streams long enough that a busy relay, which may read several events at once,
                # still sees gaps between content chunks (the inter-token latency panels).
                max_tokens=24 if stream else 8,
            )
            if stream:
                chunks = list(
                    client.chat.completions.create(**request, stream=True, stream_options={"include_usage": True})
                )
                assert chunks[-1].usage.completion_tokens > 0
            else:
                assert client.chat.completions.create(**request).usage.completion_tokens > 0

        prom.wait_until("gateway_engine_up", lambda r: total(r) == 1)
        # First requests create the per-model series; the next ones make them grow in the window.
        send(True, 0)
        send(False, 0)
        once = dict(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        limited.chat.completions.create(**once)
        with pytest.raises(openai.RateLimitError):
            limited.chat.completions.create(**once)
        prom.wait_until("sum(gateway_requests_total)", lambda r: total(r) == 4)
        queries_before = total(prom.query("gateway_engine_prefix_cache_queries_total"))
        for i in range(1, 4):
            send(True, i)
            send(i == 3, i + 10)  # and two non-streaming ones
        prom.wait_until("sum(gateway_requests_total)", lambda r: total(r) == 10)
        prom.wait_until("gateway_engine_prefix_cache_queries_total", lambda r: total(r) > queries_before)
        # One more scrape, so every rate has two points after the last request.
        scraped = total(prom.query("max(timestamp(gateway_requests_total))"))
        prom.wait_until("max(timestamp(gateway_requests_total))", lambda r: total(r) > scraped)

        # The metrics say what happened: 5 streamed requests, 3 non-streamed.
        ttft = prom.query("sum(gateway_time_to_first_token_seconds_count)")
        assert total(ttft) == 5
        plain = prom.query('sum(gateway_request_duration_seconds_count{stream="false"})')
        assert total(plain) == 5  # and the limited tenant's two (its 200 and its 429)
        assert model in prom.label_values("model", "gateway_requests_total")
        assert total(prom.query("sum(gateway_inter_token_latency_seconds_count)")) > 0, "no gap between chunks"

        window_s = time.monotonic() - started + 30

        empty = []
        for where, title, expr in dashboard_queries():
            if title.startswith("variable "):
                continue  # checked above through the label values API
            if any(name in expr for name in NO_DATA_HERE):
                continue
            result = prom.query(grafana_expr(expr, window_s))
            values = [float(r["value"][1]) for r in result]
            if not any(math.isfinite(v) for v in values):
                empty.append(f"{where}: {title}: {expr} -> {result}")
        for name, expr in alert_exprs():
            result = prom.query(without_threshold(expr))
            if not any(math.isfinite(float(r["value"][1])) for r in result):
                empty.append(f"alert {name}: {expr} -> {result}")
        assert not empty, "queries without data:\n" + "\n".join(empty)

        # Prometheus loaded every rule and evaluates it without error.
        rules = prom.wait_rules_evaluated()
        assert {r["name"] for r in rules} == {name for name, _ in alert_exprs()}
        assert all(r["health"] == "ok" for r in rules), rules
