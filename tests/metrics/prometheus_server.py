"""A real Prometheus server for tests: started on a free loopback port, stopped on every path."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import yaml

from tests.support import WAIT_TIMEOUT, free_port, wait_http


class Prometheus:
    """A running Prometheus: its base URL and a few HTTP API calls."""

    def __init__(self, url: str):
        self.url = url

    def _get(self, path: str, **params: str) -> dict:
        response = httpx.get(self.url + path, params=params, timeout=10.0)
        body = response.json()
        if response.status_code != 200 or body.get("status") != "success":
            raise AssertionError(f"{path} {params}: {response.status_code} {body}")
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        """The instant vector (list of {metric, value}) `expr` evaluates to now."""
        data = self._get("/api/v1/query", query=expr)
        assert data["resultType"] == "vector", (expr, data["resultType"])
        return data["result"]

    def label_values(self, label: str, match: str) -> list[str]:
        return self._get(f"/api/v1/label/{label}/values", **{"match[]": match})

    def targets_up(self) -> bool:
        active = self._get("/api/v1/targets")["activeTargets"]
        return bool(active) and all(t["health"] == "up" for t in active)

    def wait_rules_evaluated(self, timeout: float = WAIT_TIMEOUT) -> list[dict]:
        """Every loaded rule, once each has been evaluated at least once."""
        deadline = time.monotonic() + timeout
        while True:
            groups = self._get("/api/v1/rules")["groups"]
            rules = [rule for group in groups for rule in group["rules"]]
            if rules and all(r.get("lastEvaluation", "").startswith("2") for r in rules):
                return rules
            if time.monotonic() > deadline:
                raise TimeoutError(f"rules not evaluated within {timeout} s: {rules}")
            time.sleep(0.2)

    def wait_until(self, expr: str, predicate, timeout: float = WAIT_TIMEOUT) -> list[dict]:
        """Poll `expr` until predicate(result) is true; returns that result."""
        deadline = time.monotonic() + timeout
        result: list[dict] = []
        while time.monotonic() < deadline:
            result = self.query(expr)
            if predicate(result):
                return result
            time.sleep(0.2)
        raise TimeoutError(f"{expr}: condition not met within {timeout} s; last result {result}")


@contextlib.contextmanager
def run_prometheus(
    scrape_url: str, *, rule_files: list[Path] = (), interval: str = "1s", job: str = "gateway"
) -> Iterator[Prometheus]:
    """Start `prometheus` scraping `scrape_url` (http://host:port) every `interval`."""
    binary = shutil.which("prometheus")
    if binary is None:
        raise RuntimeError("prometheus is not installed (make prometheus)")
    with tempfile.TemporaryDirectory(prefix="prom-test-") as tmp:
        config = {
            "global": {"scrape_interval": interval, "evaluation_interval": interval},
            "rule_files": [str(p) for p in rule_files],
            "scrape_configs": [{"job_name": job, "static_configs": [{"targets": [scrape_url.split("://", 1)[1]]}]}],
        }
        config_file = Path(tmp) / "prometheus.yml"
        config_file.write_text(yaml.safe_dump(config))
        port = free_port()
        log = open(Path(tmp) / "prometheus.log", "wb")
        process = subprocess.Popen(
            [
                binary,
                f"--config.file={config_file}",
                f"--storage.tsdb.path={tmp}/data",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            url = f"http://127.0.0.1:{port}"
            try:
                wait_http(url + "/-/ready", timeout=30)
            except TimeoutError:
                raise RuntimeError("prometheus did not start: " + (Path(tmp) / "prometheus.log").read_text()) from None
            yield Prometheus(url)
        finally:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            log.close()
