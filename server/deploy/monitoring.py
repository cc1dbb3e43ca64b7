"""The monitoring half of the compose deployment: Prometheus, Alertmanager and Grafana.

None of them waits for the gateway or an engine: during a first boot (weights downloading, then
loading) the dashboards are up from the first minute and show the engines as down, and the alert
rules (docker/prometheus/alerts.yml) can fire. Prometheus scrapes the gateway and every engine:
engine containers by service name, engines by URL with that URL's scheme and path. It sends
firing alerts to Alertmanager, whose one receiver is a webhook at ALERT_WEBHOOK_URL (a
placeholder that goes nowhere until it is set; the alerts still show on the dashboard's alert
list and in Alertmanager's own page).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from server.config import parse_dns
from server.deploy.files import Quoted
from server.deploy.plan import DeploymentPlan

PROMETHEUS_IMAGE = "prom/prometheus:v3.5.0"
ALERTMANAGER_IMAGE = "prom/alertmanager:v0.28.1"
GRAFANA_IMAGE = "grafana/grafana:12.1.1"

PROMETHEUS_PORT = 9090
ALERTMANAGER_PORT = 9093
GRAFANA_PORT = 3000
SCRAPE_INTERVAL = "10s"
RULES_IN_CONTAINER = "/etc/prometheus/alerts.yml"  # docker/prometheus/alerts.yml (METRICS)
ALERTMANAGER_CONFIG_IN_CONTAINER = "/etc/alertmanager/alertmanager.yml"
# The receiver's URL: compose fills it in from the host's environment when it starts the stack.
# Unset, it points at a closed port on Alertmanager's own loopback, so notifications fail in
# Alertmanager's log (which names this variable) instead of reaching a stranger.
WEBHOOK_ENV = "ALERT_WEBHOOK_URL"
WEBHOOK_PLACEHOLDER = f"http://127.0.0.1:9/set-{WEBHOOK_ENV}"


def prometheus_service(prometheus_file: str) -> dict[str, Any]:
    return {
        "image": PROMETHEUS_IMAGE,
        "command": [
            "--config.file=/etc/prometheus/prometheus.yml",
            "--storage.tsdb.path=/prometheus",
            "--storage.tsdb.retention.time=15d",
        ],
        "volumes": [
            f"./{prometheus_file}:/etc/prometheus/prometheus.yml:ro",
            f"./prometheus/alerts.yml:{RULES_IN_CONTAINER}:ro",
            "prometheus-data:/prometheus",
        ],
        # No login on Prometheus: reachable from this host only (ssh -L 9090:localhost:9090).
        "ports": [Quoted(f"127.0.0.1:{PROMETHEUS_PORT}:{PROMETHEUS_PORT}")],
        "restart": "unless-stopped",
    }


def alertmanager_config() -> dict[str, Any]:
    """Every alert to one webhook receiver, grouped per alert and model, resolved ones too."""
    return {
        "route": {
            "receiver": "webhook",
            "group_by": ["alertname", "model"],
            "group_wait": "30s",
            "group_interval": "5m",
            "repeat_interval": "4h",
        },
        "receivers": [
            {
                "name": "webhook",
                "webhook_configs": [{"url": f"${{{WEBHOOK_ENV}:-{WEBHOOK_PLACEHOLDER}}}", "send_resolved": True}],
            }
        ],
    }


def alertmanager_service() -> dict[str, Any]:
    return {
        "image": ALERTMANAGER_IMAGE,
        "command": [f"--config.file={ALERTMANAGER_CONFIG_IN_CONTAINER}", "--storage.path=/alertmanager"],
        # The config is the compose file's own `configs.alertmanager` (interpolated by compose).
        "configs": [{"source": "alertmanager", "target": ALERTMANAGER_CONFIG_IN_CONTAINER}],
        "volumes": ["alertmanager-data:/alertmanager"],
        # No login on Alertmanager either: this host only.
        "ports": [Quoted(f"127.0.0.1:{ALERTMANAGER_PORT}:{ALERTMANAGER_PORT}")],
        "restart": "unless-stopped",
    }


def grafana_service() -> dict[str, Any]:
    return {
        "image": GRAFANA_IMAGE,
        "environment": {
            "GF_SECURITY_ADMIN_USER": "admin",
            # No default password: compose refuses to start without one.
            "GF_SECURITY_ADMIN_PASSWORD": "${GRAFANA_ADMIN_PASSWORD:?set GRAFANA_ADMIN_PASSWORD}",
            "GF_USERS_ALLOW_SIGN_UP": "false",
        },
        "volumes": [
            "./grafana/provisioning:/etc/grafana/provisioning:ro",
            "./grafana/dashboards:/var/lib/grafana/dashboards:ro",
            "grafana-data:/var/lib/grafana",
        ],
        # On every interface, deliberately: Grafana has its own login (no default password).
        "ports": [Quoted(f"0.0.0.0:{GRAFANA_PORT}:{GRAFANA_PORT}")],
        "restart": "unless-stopped",
    }


def monitoring_services(prometheus_file: str) -> dict[str, Any]:
    return {
        "prometheus": prometheus_service(prometheus_file),
        "alertmanager": alertmanager_service(),
        "grafana": grafana_service(),
    }


def render_prometheus(plan: DeploymentPlan, *, gateway: str, dns: Sequence[tuple[str, str]] = ()) -> dict[str, Any]:
    """Prometheus config: the gateway, and every engine (containers and remote URLs) by model.

    An engine by URL is scraped the way its URL says: `https://host/base` -> scheme https,
    /base/metrics (per target, through the `__scheme__` and `__metrics_path__` labels).
    Engines found by DNS (`dns`: (model, `NAME:PORT` or SRV name)) are found by Prometheus the
    same way, every resolution (`dns_sd_configs`), and labelled with their model by name.
    """
    upstreams = [(engine.model, engine.url) for engine in plan.engines]
    upstreams += [(model.name, url) for model in plan.models for url in model.remote]
    groups: dict[tuple[str, str, str], list[str]] = {}
    for model, url in upstreams:
        target, scheme, path = scrape_target(url)
        groups.setdefault((model, scheme, path), []).append(target)
    static_configs = []
    for (model, scheme, path), targets in groups.items():
        labels = {"model": model}
        if scheme != "http":
            labels["__scheme__"] = scheme
        if path != "/metrics":
            labels["__metrics_path__"] = path
        static_configs.append({"targets": targets, "labels": labels})
    vllm: dict[str, Any] = {"job_name": "vllm"}
    if static_configs:
        vllm["static_configs"] = static_configs
    if dns:
        vllm.update(dns_discovery(dns))
    return {
        "global": {"scrape_interval": SCRAPE_INTERVAL, "evaluation_interval": SCRAPE_INTERVAL},
        "rule_files": [RULES_IN_CONTAINER],
        "alerting": {"alertmanagers": [{"static_configs": [{"targets": [f"alertmanager:{ALERTMANAGER_PORT}"]}]}]},
        "scrape_configs": [
            {"job_name": "gateway", "static_configs": [{"targets": [gateway]}]},
            vllm,
        ],
    }


def dns_discovery(dns: Sequence[tuple[str, str]]) -> dict[str, Any]:
    """`dns_sd_configs` (one per name) and the relabelling that gives each found engine its `model`."""
    configs: list[dict[str, Any]] = []
    relabel: list[dict[str, Any]] = []
    for model, target in dns:
        name, port = parse_dns(target)
        name = name.rstrip(".")
        if port is None:
            configs.append({"names": [name], "type": "SRV", "refresh_interval": SCRAPE_INTERVAL})
        else:
            configs.append({"names": [name], "type": "A", "port": port, "refresh_interval": SCRAPE_INTERVAL})
        relabel.append(
            {
                "source_labels": ["__meta_dns_name"],
                "regex": re.escape(name),
                "target_label": "model",
                "replacement": model,
            }
        )
    return {"dns_sd_configs": configs, "relabel_configs": relabel}


def scrape_target(url: str) -> tuple[str, str, str]:
    """(host:port, scheme, metrics path) of an engine's base URL."""
    parts = urlsplit(url)
    scheme = parts.scheme or "http"
    host = parts.hostname or ""
    if ":" in host:  # an IPv6 literal
        host = f"[{host}]"
    port = parts.port or (443 if scheme == "https" else 80)
    return f"{host}:{port}", scheme, parts.path.rstrip("/") + "/metrics"
