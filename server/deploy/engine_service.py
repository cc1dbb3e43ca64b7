"""One engine in the compose file: its service (image, command, mounts, health check, drain, GPUs).

A profile with `device: gpu` runs in the official `vllm/vllm-openai` image with NVIDIA GPUs
reserved; a `device: cpu` profile runs in our vllm-cpu image (docker/Dockerfile.vllm-cpu), which
carries the tiny model. The command is the one engine renderer's (`server.engine.render.engine_argv`,
which `engine-args` and the supervisor use too), plus vLLM's `--shutdown-timeout`: on SIGTERM the
engine lets in-flight requests finish for that long, and Docker waits that plus a margin before
SIGKILL. An engine scaled behind one DNS name (server.deploy.scaled) is the same service, run
`replicas` times.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from server.deploy.containers import (
    ENGINE_DRAIN_SECONDS,
    HEALTH_PROBE,
    HF_CACHE_VOLUME,
    HF_HOME,
    MODELS_IN_CONTAINER,
    START_PERIOD,
    STOP_MARGIN_SECONDS,
    TINY_MODEL_IN_IMAGE,
    VLLM_CACHE,
    VLLM_CPU_IMAGE,
    VLLM_GPU_IMAGE,
)
from server.deploy.downloads import engine_dependency
from server.deploy.errors import ComposeError
from server.deploy.plan import PlannedEngine
from server.deploy.scaled import ScaledService
from server.engine.profiles import Profile
from server.engine.render import engine_argv


def container_model(profile: Profile, compose_dir: Path) -> tuple[str | None, str | None]:
    """(model argument inside the container, bind mount for it) for a profile.

    A hub id is passed as it is (the engine downloads it into the shared cache). The tiny model
    is built into the CPU image. Any other local folder is mounted read-only, by a path relative
    to the compose file so the rendering does not depend on where the checkout lives.
    """
    path = profile.model_path
    if path is None:
        return None, None
    if profile.build_tiny_model:
        if profile.device != "cpu":
            raise ComposeError(
                f"{profile.name}: the tiny model is built into the CPU engine image only; use `device: cpu` for it"
            )
        return TINY_MODEL_IN_IMAGE, None
    inside = f"{MODELS_IN_CONTAINER}/{path.name}"
    source = Path(_relative(path, compose_dir))
    return inside, f"{source.as_posix()}:{inside}:ro"


def _relative(path: Path, start: Path) -> str:
    rel = os.path.relpath(path, start)
    return rel if rel.startswith(".") else f"./{rel}"


def engine_command(engine: PlannedEngine, compose_dir: Path) -> list[str]:
    """The container's arguments after the image's entrypoint: the one renderer's output, and the drain."""
    model, _ = container_model(engine.profile, compose_dir)
    argv = engine_argv(
        engine.profile,
        host="0.0.0.0",
        port=engine.port,
        launcher="image",
        model=model,
        kv_events_port=engine.kv_events_port,
    )
    if "shutdown-timeout" in engine.profile.vllm:  # rendered by engine_argv already
        return argv
    return [*argv, "--shutdown-timeout", str(ENGINE_DRAIN_SECONDS)]


def engine_drain_seconds(profile: Profile) -> int:
    """How long vLLM lets in-flight requests run after SIGTERM: the profile's `shutdown-timeout`, else ours."""
    value = profile.vllm.get("shutdown-timeout", ENGINE_DRAIN_SECONDS)
    if isinstance(value, bool) or not isinstance(value, int | str) or not str(value).isdigit():
        raise ComposeError(f"{profile.name}: vllm.shutdown-timeout must be whole seconds, got {value!r}")
    return int(value)


def _healthcheck(port: int, start_period: str) -> dict[str, Any]:
    return {
        "test": ["CMD", "python3", "-c", HEALTH_PROBE.format(port=port)],
        "interval": "30s",
        "timeout": "10s",
        "retries": 3,
        "start_period": start_period,
        "start_interval": "10s",
    }


def engine_service(engine: PlannedEngine, compose_dir: Path) -> dict[str, Any]:
    """The service of one planned engine (`engine-<model>-<i>`), waiting for its model's download."""
    profile = engine.profile
    drain = engine_drain_seconds(profile)
    environment: dict[str, str] = {"HF_TOKEN": "${HF_TOKEN:-}", "HF_HOME": HF_HOME, "VLLM_CACHE_ROOT": VLLM_CACHE}
    environment.update(profile.env)
    volumes = [f"{HF_CACHE_VOLUME}:{HF_HOME}", f"vllm-cache:{VLLM_CACHE}"]
    _, mount = container_model(profile, compose_dir)
    if mount:
        volumes.append(mount)
    service: dict[str, Any] = {}
    if profile.device == "gpu":
        service["image"] = VLLM_GPU_IMAGE
    else:
        service["image"] = VLLM_CPU_IMAGE
        service["build"] = {"context": "..", "dockerfile": "docker/Dockerfile.vllm-cpu"}
        service["pull_policy"] = "build"  # a local image: no registry has it
    service["command"] = engine_command(engine, compose_dir)
    service["environment"] = environment
    service["volumes"] = volumes
    # PyTorch's workers share tensors through /dev/shm; Docker's 64 MB default is far too small.
    service["ipc"] = "host"
    service["restart"] = "unless-stopped"
    service["healthcheck"] = _healthcheck(engine.port, START_PERIOD[profile.device])
    service["stop_grace_period"] = f"{drain + STOP_MARGIN_SECONDS}s"
    if dependency := engine_dependency(engine):
        service["depends_on"] = dependency
    if engine.gpus:
        service["deploy"] = {
            "resources": {
                "reservations": {
                    "devices": [
                        {"driver": "nvidia", "device_ids": [str(gpu) for gpu in engine.gpus], "capabilities": ["gpu"]}
                    ]
                }
            }
        }
    return service


def scaled_engine_service(scaled: ScaledService, compose_dir: Path) -> dict[str, Any]:
    """An engine service run `replicas` times behind its one name (server.deploy.scaled)."""
    service = engine_service(scaled.engine, compose_dir)
    service["deploy"] = {"replicas": scaled.replicas}
    return service
