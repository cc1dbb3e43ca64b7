"""The gateway both real-vLLM flow tests put in front of one tiny-cpu-priority engine: two tenants,
the planner (interactive) and the articles (batch), each with its key; and how both read the
engine's /metrics."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from server.gateway.settings import GatewaySettings

PROFILE = Path(__file__).resolve().parents[3] / "configs" / "profiles" / "tiny-cpu-priority.yaml"
KEYS = {"planner": "sk-real-planner", "articles": "sk-real-articles"}


def two_tenants(url: str, **extra: Any) -> GatewaySettings:
    """The gateway's settings for the engine at `url`, with `extra` settings (flow, timeouts) on top."""
    return GatewaySettings.model_validate(
        {
            "models": [{"name": "tiny", "profile": str(PROFILE), "urls": [url]}],
            "tenants": [
                {"name": "planner", "api_keys": [KEYS["planner"]], "priority": "interactive"},
                {"name": "articles", "api_keys": [KEYS["articles"]], "priority": "batch"},
            ],
            **extra,
        }
    )


def metric_sum(text: str, name: str) -> float:
    """The sum of every series of `name` in a /metrics text (vLLM labels each by model and engine)."""
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.split("{", 1)[0].split(" ", 1)[0] == name
    )
