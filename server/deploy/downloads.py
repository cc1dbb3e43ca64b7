"""The one-shot download of each hub model into the shared Hugging Face cache, before its engines start.

vLLM downloads weights with its progress bar off, so an engine's log says nothing for the whole
download and its health-check start period runs out on a slow link. Compose runs
`hf download <model>` (huggingface_hub's CLI, which the vLLM image carries) once per hub model
instead, into the cache volume every engine mounts, with its progress in
`docker compose logs -f download-<model>`. Its engines wait for it to finish
(`service_completed_successfully`); a failed download (a wrong token, a licence not accepted)
stops them from starting and `docker compose up` says which service failed.

A gated model (profile `gated: true`, e.g. meta-llama/*) needs HF_TOKEN: the download service
reads it as `${HF_TOKEN:?...}`, so compose refuses the whole file at once, naming the model,
instead of an engine restarting forever on 401.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from server.deploy.plan import PlannedEngine, slug

# Files vLLM does not load: Meta's original checkpoints (a second copy of the weights, as .pth).
# One pattern only: huggingface_hub's argparse CLI keeps only the last of repeated `--exclude`s,
# its later CLI takes one value per flag. An engine that needs a skipped file downloads it itself.
EXCLUDE = ("original/*",)


def download_service_name(model: str) -> str:
    """`download-<hub id as a DNS label>`: one per hub model, whatever its replicas."""
    return f"download-{slug(model)}"


def token_variable(engine: PlannedEngine) -> str:
    """HF_TOKEN as the download of this engine's model reads it: required for a gated model."""
    if engine.profile.gated:
        return f"${{HF_TOKEN:?{engine.profile.model} is gated: accept its licence, then set HF_TOKEN}}"
    return "${HF_TOKEN:-}"


def needs_download(engine: PlannedEngine) -> bool:
    """A hub id (not a local folder, not the tiny model built into the CPU image)."""
    return engine.profile.model_path is None


def download_command(engine: PlannedEngine) -> list[str]:
    """`hf download` arguments after the entrypoint: the model, its revision, what to skip."""
    argv = [engine.profile.model]
    revision = engine.profile.vllm.get("revision")
    if isinstance(revision, str):
        argv += ["--revision", revision]
    for pattern in EXCLUDE:
        argv += ["--exclude", pattern]
    return argv


def download_services(
    engines: Iterable[PlannedEngine], *, image: str, hf_home: str, cache_volume: str
) -> dict[str, Any]:
    """Service name -> the one-shot service, for every hub model the engines serve."""
    services: dict[str, Any] = {}
    for engine in engines:
        if not needs_download(engine):
            continue
        name = download_service_name(engine.profile.model)
        if name in services:
            continue
        services[name] = {
            "image": image,
            "entrypoint": ["hf", "download"],
            "command": download_command(engine),
            "environment": {
                "HF_TOKEN": token_variable(engine),
                "HF_HOME": hf_home,
                # Progress bars on, whatever the image's default (they go to the service's log).
                "HF_HUB_DISABLE_PROGRESS_BARS": "0",
            },
            "volumes": [f"{cache_volume}:{hf_home}"],
            "restart": "no",  # one-shot: done once the cache holds the model
        }
    return services


def engine_dependency(engine: PlannedEngine) -> dict[str, Any]:
    """What an engine waits for: its model's download, when it has one."""
    if not needs_download(engine):
        return {}
    return {download_service_name(engine.profile.model): {"condition": "service_completed_successfully"}}
