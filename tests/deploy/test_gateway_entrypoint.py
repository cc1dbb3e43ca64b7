"""The gateway container's command, run here as it runs in the container.

The compose file's gateway command (`python -m server serve --config /app/docker/gateway.yaml
...`) is run with the container's mounts mapped back to the checkout and the engine services'
host names swapped for stand-in engines on loopback. It must answer /health and list the models
on /v1/models, and it must need nothing outside the gateway image's pinned requirements.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import sysconfig
import time
from importlib import metadata
from pathlib import Path

import httpx
import pytest
from packaging.requirements import Requirement

from standin import StandinConfig, build_app
from tests.support import free_port, serve_in_thread, wait_http

from .conftest import DOCKER, ROOT, VARIANTS

# Runs `python -m server ARGS...` like the image's ENTRYPOINT, with only the packages the image
# has: importing a module of any other installed distribution fails as it would there (libraries
# that use a package only when present take their fallback path). Records the modules loaded.
RUNNER = """\
import atexit, json, runpy, sys
out, blocked = sys.argv[1], set(json.loads(sys.argv[2]))

class NotInTheImage:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in blocked:
            raise ModuleNotFoundError(f"No module named {name!r} (not in the gateway image)", name=name)
        return None

sys.meta_path.insert(0, NotInTheImage())
atexit.register(lambda: json.dump(
    {name: getattr(module, "__file__", None) for name, module in list(sys.modules.items())},
    open(out, "w")))
sys.argv = ["server", *sys.argv[3:]]
runpy.run_module("server", run_name="__main__", alter_sys=True)
"""


def image_packages() -> set[str]:
    """Distributions in the gateway image: the pinned requirements and the project itself."""
    pinned = {_key(metadata.distribution("llm-serving").metadata["Name"])}
    for line in (DOCKER / "requirements-gateway.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            pinned.add(_key(Requirement(line).name))
    return pinned


def not_in_the_image() -> list[str]:
    """Top-level modules installed here whose distributions the image does not have."""
    pinned = image_packages()
    return sorted(
        name
        for name, dists in metadata.packages_distributions().items()
        if not {_key(d) for d in dists} & pinned and name != "server"
    )


def container_mounts(service: dict) -> dict[str, Path]:
    out = {}
    for volume in service["volumes"]:
        source, target = volume.split(":")[:2]
        out[target] = (DOCKER / source).resolve()
    return out


# The DNS variant's gateway finds its engines by name, not URL: test_compose_dns.py runs this same
# command with that config against a DNS server on loopback.
@pytest.mark.parametrize("variant", [v for v in VARIANTS if v.name != "dns"], ids=lambda v: v.name)
def test_gateway_command_serves_health_and_models_in_front_of_engines(variant, tmp_path):
    compose = variant.compose_data()
    service = compose["services"]["gateway"]
    command = list(service["command"])
    mounts = container_mounts(service)

    # The container's file system, rebuilt under tmp_path: /app/docker/gateway.yaml and /app/configs.
    config_in_container = command[command.index("--config") + 1]
    config = tmp_path / Path(config_in_container).relative_to("/app")
    config.parent.mkdir(parents=True)
    (tmp_path / "configs").symlink_to(mounts["/app/configs"])

    # One stand-in engine per engine service, serving the model the gateway routes to it.
    text = mounts[config_in_container].read_text()
    engines = sorted(name for name in compose["services"] if name.startswith("engine-"))
    models = {}
    with_contexts = []
    for name in engines:
        argv = compose["services"][name]["command"]
        model = argv[argv.index("--served-model-name") + 1]
        context = serve_in_thread(build_app(StandinConfig(model=model, ttft_ms=1, itl_ms=1, tokens=4)))
        url = context.__enter__()
        with_contexts.append(context)
        text, swapped = re.subn(rf"http://{re.escape(name)}:8000\b", url, text)
        assert swapped == 1, f"{name} appears once in the gateway config"
        models[model] = url
    try:
        config.write_text(text)
        port = free_port()
        command[command.index("--config") + 1] = str(config)
        command[command.index("--host") + 1] = "127.0.0.1"
        command[command.index("--port") + 1] = str(port)
        modules_file = tmp_path / "modules.json"
        process = subprocess.Popen(
            [sys.executable, "-c", RUNNER, str(modules_file), json.dumps(not_in_the_image()), *command],
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            # The image has this checkout's server/ installed; so does PYTHONPATH here.
            env={**{k: v for k, v in os.environ.items() if k != "GATEWAY_API_KEYS"}, "PYTHONPATH": str(ROOT)},
        )
        try:
            base = f"http://127.0.0.1:{port}"
            wait_while_running(process, f"{base}/health")
            wait_http(f"{base}/ready", timeout=15)
            listed = httpx.get(f"{base}/v1/models", timeout=5).json()
            assert sorted(card["id"] for card in listed["data"]) == sorted(models)
            for model in models:
                reply = httpx.post(
                    f"{base}/v1/chat/completions",
                    timeout=10,
                    json={"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "hello"}]},
                )
                assert reply.status_code == 200, reply.text
                assert reply.json()["model"] == model
        finally:
            process.send_signal(signal.SIGTERM)
            output, _ = process.communicate(timeout=30)
        assert process.returncode == 0, output
    finally:
        for context in with_contexts:
            context.__exit__(None, None, None)
    assert_only_pinned_packages_loaded(json.loads(modules_file.read_text()))


def wait_while_running(process: subprocess.Popen, url: str, timeout: float = 30.0) -> None:
    """Wait for `url` to answer 200; fail at once, with the log, if the process exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"exited with {process.returncode}:\n{process.communicate()[0]}")
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    process.kill()
    raise AssertionError(f"{url} not up within {timeout} s:\n{process.communicate()[0]}")


def assert_only_pinned_packages_loaded(modules: dict[str, str | None]) -> None:
    """Every third-party module the gateway loaded comes from docker/requirements-gateway.txt."""
    pinned = image_packages()
    owners = metadata.packages_distributions()
    files = {name: Path(file).resolve() for name, file in modules.items() if "." not in name and file}
    assert "uvicorn" in files, "the runner recorded the gateway's modules"
    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    outside = {}
    for name, path in sorted(files.items()):
        in_stdlib = path.is_relative_to(stdlib) and "site-packages" not in path.parts
        if in_stdlib or path.is_relative_to(ROOT / "server") or name.startswith("__editable__"):
            continue  # Python's own library, or the project's code (and its editable-install hook)
        dists = {_key(d) for d in owners.get(name, [])}
        if not dists & pinned:
            outside[name] = sorted(dists) or str(path)
    assert not outside, f"the gateway image lacks these: {outside}"
    assert not {"torch", "vllm", "transformers"} & set(files)


def _key(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()
