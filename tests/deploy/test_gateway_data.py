"""The gateway's data folder (GATEWAY_DATA_DIR: the response store's SQLite file) is writable in
every container it runs in: the image makes /data its user's, compose mounts a named volume there,
the Helm chart a volume of its own. Without it the gateway, running as uid 10001 in /app, could not
create its store and would refuse to start."""

from __future__ import annotations

import re

import yaml

from .conftest import ROOT
from .test_helm import named, render, values_for


def test_the_image_gives_its_user_a_data_folder_and_names_it():
    dockerfile = (ROOT / "docker/Dockerfile.gateway").read_text()
    assert re.search(r"mkdir /data && chown 10001:10001 /data", dockerfile)
    assert "ENV GATEWAY_DATA_DIR=/data" in dockerfile
    assert dockerfile.index("chown 10001:10001 /data") < dockerfile.index("USER 10001:10001")


def test_every_compose_file_mounts_a_named_volume_on_the_data_folder():
    for name in ("compose.yaml", "compose.cpu.yaml", "compose.dns.yaml"):
        rendered = yaml.safe_load((ROOT / "docker" / name).read_text())
        assert "gateway-data:/data" in rendered["services"]["gateway"]["volumes"], name
        assert "gateway-data" in rendered["volumes"], name


def test_the_chart_mounts_a_writable_volume_on_the_data_folder():
    spec = named(render(values_for(ROOT / "configs/gateway.gpu.yaml")), "Deployment", "llm-llm-serving-gateway")[
        "spec"
    ]["template"]["spec"]
    (container,) = spec["containers"]
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts["data"]["mountPath"] == "/data" and not mounts["data"].get("readOnly")
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert "emptyDir" in volumes["data"]
