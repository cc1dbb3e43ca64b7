"""A malformed tenants config is refused by `python -m server serve` at start (exit 2), with the
config file and the key named, before any worker starts and without echoing a key."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
MODEL = "models:\n  - name: m\n    urls: [http://127.0.0.1:9]\n"
BAD = [
    (
        "tenants:\n  - name: planner\n    api_keys: [sk-secret-1]\n    limits: {requests_per_minut: 3}\n",
        "tenants.0.limits.requests_per_minut",
    ),
    ("tenants:\n  - name: planner\n    api_keys: [sk-secret-1]\n    priority: urgent\n", "tenants.0.priority"),
    ("tenants:\n  - name: planner\n    priority: batch\n", "tenants.0: a tenant needs api_keys, api_keys_env or"),
    (
        "tenants:\n  - name: a\n    api_keys: [sk-secret-1]\n  - name: b\n    api_keys: [sk-secret-1]\n",
        "tenants.1 (b): one of its API keys is also a key of tenant a",
    ),
    ("tenants: []\n", "tenants"),
]


@pytest.mark.parametrize(("tenants", "named"), BAD, ids=["unknown-key", "bad-value", "no-key", "shared-key", "empty"])
def test_serve_refuses_a_malformed_tenants_config_with_the_file_and_the_key(tmp_path, tenants, named):
    config = tmp_path / "gateway.yaml"
    config.write_text(MODEL + tenants)
    done = subprocess.run(
        [sys.executable, "-m", "server", "serve", "--config", str(config), "--workers", "2"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"error: {config}" in done.stderr and named in done.stderr, done.stderr
    assert "sk-secret-1" not in done.stdout + done.stderr
    assert "Traceback" not in done.stderr
