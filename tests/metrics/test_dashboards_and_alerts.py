"""The Grafana dashboards and alert rules, checked without a Prometheus server running:
metric names against what the code exports, panel layout, and the rules with promtool."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from server.gateway.observability.metrics import GatewayMetrics
from server.gateway.replicas.collector import EngineCollector
from server.gateway.replicas.engine import Engine
from server.gateway.replicas.kv_events import KvEventsCollector
from server.gateway.replicas.precise import PreciseIndex
from server.gateway.replicas.scraper import parse_engine_metrics
from tests.gateway.flow.samples import populated_flow_collector

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = sorted((ROOT / "docker" / "grafana" / "dashboards").glob("*.json"))
ALERTS = ROOT / "docker" / "prometheus" / "alerts.yml"
ALERT_TESTS = Path(__file__).parent / "data" / "alerts_test.yml"
VLLM_TEXT = (Path(__file__).parent / "data" / "vllm-0.32-metrics.txt").read_text()
NAME = re.compile(r"\b(gateway_[a-z0-9_]+)\b")


def panels(dashboard: dict) -> list[dict]:
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def dashboard_queries() -> list[tuple[str, str, str]]:
    """(dashboard file, panel title, expr) for every query of every panel and variable."""
    out = []
    for path in DASHBOARDS:
        dashboard = json.loads(path.read_text())
        for panel in panels(dashboard):
            for target in panel.get("targets", []):
                out.append((path.name, panel["title"], target["expr"]))
        for var in dashboard.get("templating", {}).get("list", []):
            if var["type"] == "query":
                out.append((path.name, f"variable {var['name']}", var["definition"]))
    return out


def alert_exprs() -> list[tuple[str, str]]:
    rules = yaml.safe_load(ALERTS.read_text())
    return [(r["alert"], r["expr"]) for g in rules["groups"] for r in g["rules"]]


def exported_names() -> set[str]:
    """Every sample name a scrape of the gateway can show, with every series populated."""
    metrics = GatewayMetrics()
    metrics.request_started("tiny")
    metrics.request_finished("tiny", 200, 1.0, streamed=True)
    engine = Engine("tiny", "http://127.0.0.1:9", planned_kv_tokens=1000)
    engine.record_scrape(parse_engine_metrics(VLLM_TEXT), at=1.0)
    metrics.registry.register(EngineCollector([engine]))
    metrics.routing_decision("tiny", "prefix")
    metrics.tenant_usage("planner", "tiny", 200, prompt=10, cached=4, completion=5)
    index = PreciseIndex()
    index.set_live(engine.id, True)
    index.purge(engine.id, "gap")
    metrics.registry.register(KvEventsCollector(index, {engine.id: "tiny"}))
    metrics.registry.register(populated_flow_collector(engine))  # gateway_flow_* (server.gateway.flow)
    text = generate_latest(metrics.registry).decode()
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}


def test_there_are_dashboards_with_queries():
    assert DASHBOARDS
    assert len(dashboard_queries()) >= 20


def test_every_metric_name_in_dashboards_and_alerts_is_exported():
    names = exported_names()
    used = set()
    for where, title, expr in dashboard_queries() + [("alerts", *a) for a in alert_exprs()]:
        for name in NAME.findall(expr):
            assert name in names, f"{where}: {title}: {name} is not exported by the gateway"
            used.add(name)
    # And the dashboards show every family we export (engine and gateway alike).
    families = {re.sub(r"_(bucket|sum|count|total)$", "", n) for n in names if not n.endswith("_created")}
    shown = {re.sub(r"_(bucket|sum|count|total)$", "", n) for n in used}
    assert families - shown == set()


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_dashboard_shape(path):
    dashboard = json.loads(path.read_text())
    assert 36 <= dashboard["schemaVersion"] <= 41
    assert dashboard["uid"] and dashboard["title"]
    ids = [p["id"] for p in panels(dashboard)]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for panel in panels(dashboard):
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24, panel["title"]
        mine = {(x, y) for x in range(pos["x"], pos["x"] + pos["w"])
                for y in range(pos["y"], pos["y"] + pos["h"])}  # fmt: skip
        assert not cells & mine, f"{panel['title']} overlaps another panel"
        cells |= mine
        if panel["type"] == "row":
            continue
        if panel["type"] == "alertlist":  # no query: it lists the rules the datasource evaluates
            assert panel["options"]["datasource"] == PROMETHEUS_DATASOURCE_NAME, panel["title"]
            continue
        assert panel["targets"], panel["title"]
        for target in [panel, *panel["targets"]]:
            assert target["datasource"] == {"type": "prometheus", "uid": "prometheus"}
        assert all(t["expr"].strip() for t in panel["targets"])
    for var in dashboard["templating"]["list"]:
        assert var["datasource"]["uid"] == "prometheus"


PROMETHEUS_DATASOURCE_NAME = "Prometheus"  # docker/grafana/provisioning/datasources/prometheus.yml


def test_the_main_dashboard_lists_firing_and_pending_alerts_first():
    """Alerts are on the dashboard an operator opens, above everything else, from the
    provisioned Prometheus (whose rules are docker/prometheus/alerts.yml)."""
    dashboard = json.loads((ROOT / "docker/grafana/dashboards/gateway.json").read_text())
    lists = [p for p in panels(dashboard) if p["type"] == "alertlist"]
    assert len(lists) == 1
    panel = lists[0]
    assert panel["gridPos"]["y"] == 0 and panel["gridPos"]["w"] == 24
    assert panel["options"]["stateFilter"]["firing"] and panel["options"]["stateFilter"]["pending"]
    assert not panel["options"]["dashboardAlerts"]  # every rule, not only this dashboard's
    sources = yaml.safe_load((ROOT / "docker/grafana/provisioning/datasources/prometheus.yml").read_text())
    names = {s["name"]: s for s in sources["datasources"]}
    assert names[panel["options"]["datasource"]]["type"] == "prometheus"
    # Grafana lists a datasource's rules unless `manageAlerts` is turned off.
    assert names[panel["options"]["datasource"]].get("jsonData", {}).get("manageAlerts", True)


def promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=60)


@pytest.mark.prometheus
def test_alert_rules_pass_promtool_check():
    result = promtool("check", "rules", str(ALERTS))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alert_exprs())} rules found" in result.stdout


@pytest.mark.prometheus
def test_alert_rules_fire_when_they_should_promtool_unit_tests():
    result = promtool("test", "rules", str(ALERT_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr
    tested = set(re.findall(r"alertname: (\w+)", ALERT_TESTS.read_text()))
    assert tested == {name for name, _ in alert_exprs()}


def test_the_tenants_row_shows_each_usage_counter_per_tenant():
    """Issue 31's usage on the main dashboard: requests by status, 429s, prompt, cached prompt and
    completion tokens, each per tenant and filtered by the `tenant` variable (whose values come
    from the counters' own label, i.e. the configured tenants)."""
    dashboard = json.loads((ROOT / "docker/grafana/dashboards/gateway.json").read_text())
    rows = [p for p in dashboard["panels"] if p["type"] == "row"]
    assert "Tenants" in [r["title"] for r in rows]
    start = next(r["gridPos"]["y"] for r in rows if r["title"] == "Tenants")
    end = min([r["gridPos"]["y"] for r in rows if r["gridPos"]["y"] > start], default=10**6)
    row = [p for p in panels(dashboard) if start < p["gridPos"]["y"] < end]
    exprs = [t["expr"] for p in row for t in p["targets"]]
    for family in ("requests", "prompt_tokens", "cached_prompt_tokens", "completion_tokens"):
        assert any(f"gateway_tenant_{family}_total{{" in e for e in exprs), family
    assert any('code="429"' in e for e in exprs)
    for expr in exprs:
        assert 'tenant=~"$tenant"' in expr and "sum by (tenant" in expr, expr
    (variable,) = [v for v in dashboard["templating"]["list"] if v["name"] == "tenant"]
    assert variable["definition"] == "label_values(gateway_tenant_requests_total, tenant)"
