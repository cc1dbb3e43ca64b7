"""dclint (the npm docker-compose linter) on every rendered compose file: no error, no warning.

`make test` installs it project-locally (`npm install --prefix .cache/node dclint@DCLINT_VERSION`);
these tests skip only when node is absent, and fail when node is there but dclint is not
installed, so a broken install cannot pass for a clean lint. No rule is disabled: what dclint
asked for is done in the renderer (server/deploy/compose.py: services and their keys in its
order, ports in single quotes, `pull_policy: build` beside `build` + `image`).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from .conftest import ROOT, VARIANTS

DCLINT_VERSION = "3.1.0"
DCLINT = ROOT / ".cache/node/node_modules/.bin/dclint"

pytestmark = pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed (dclint runs on node)")


def dclint(*files: Path) -> list[dict]:
    """dclint's JSON report (one entry per file, each with its messages)."""
    assert DCLINT.exists(), f"dclint is not installed: npm install --prefix .cache/node dclint@{DCLINT_VERSION}"
    result = subprocess.run(
        [str(DCLINT), "--formatter", "json", "--color", "false", *map(str, files)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.stdout.strip(), result.stderr
    return json.loads(result.stdout)


def test_dclint_is_the_pinned_version():
    assert DCLINT.exists(), f"dclint is not installed: npm install --prefix .cache/node dclint@{DCLINT_VERSION}"
    package = json.loads((ROOT / ".cache/node/node_modules/dclint/package.json").read_text())
    assert package["version"] == DCLINT_VERSION


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
def test_every_rendered_compose_file_passes_dclint(variant):
    (report,) = dclint(variant.compose)
    problems = [f"{m['line']}: {m['type']} {m['rule']}: {m['message']}" for m in report["messages"]]
    assert not problems, problems


def test_dclint_can_fail(tmp_path):
    broken = tmp_path / "compose.yaml"
    broken.write_text(
        "name: x\nservices:\n  b:\n    image: app:1\n    build: .\n    ports:\n    - 8080:80\n  a:\n    image: nginx\n"
    )
    (report,) = dclint(broken)
    rules = {m["rule"] for m in report["messages"]}
    assert {"no-build-and-image", "require-quotes-in-ports", "services-alphabetical-order"} <= rules
    assert "service-image-require-explicit-tag" in rules
