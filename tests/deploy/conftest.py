"""What the deployment tests share: the repository's paths and the deployments it ships."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"


@dataclass(frozen=True)
class Variant:
    """One committed deployment: the gateway config it is rendered from and its files."""

    name: str
    config: Path
    compose: Path
    gateway: Path
    prometheus: Path

    def compose_data(self) -> dict:
        return yaml.safe_load(self.compose.read_text())

    def gateway_data(self) -> dict:
        return yaml.safe_load(self.gateway.read_text())

    def prometheus_data(self) -> dict:
        return yaml.safe_load(self.prometheus.read_text())


VARIANTS = [
    Variant(
        "gpu",
        ROOT / "configs/gateway.gpu.yaml",
        DOCKER / "compose.yaml",
        DOCKER / "gateway.yaml",
        DOCKER / "prometheus.yml",
    ),
    Variant(
        "cpu",
        ROOT / "configs/gateway.yaml",
        DOCKER / "compose.cpu.yaml",
        DOCKER / "gateway.cpu.yaml",
        DOCKER / "prometheus.cpu.yml",
    ),
    Variant(  # engines as one scaled service the gateway finds through Docker's DNS
        "dns",
        ROOT / "configs/gateway.dns.yaml",
        DOCKER / "compose.dns.yaml",
        DOCKER / "gateway.dns.yaml",
        DOCKER / "prometheus.dns.yml",
    ),
]


@pytest.fixture(params=VARIANTS, ids=lambda v: v.name)
def variant(request) -> Variant:
    return request.param
