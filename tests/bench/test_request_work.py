"""bench.request_work: bytecodes counted in two real gateways on a stand-in engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import request_work


def test_before_tenants_needs_after_tenants(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        request_work.main(["--before", "HEAD", "--before-tenants", "--output", str(tmp_path)])


def test_with_before_tenants_both_gateways_run_the_tenants_path(tmp_path: Path) -> None:
    """Both sides count the quota's and the flow gate's bytecodes: both had the tenants (and the
    key); without --before-tenants only the after side does."""
    common = ["--before", "HEAD", "--requests", "3", "--warmup", "2", "--paired", "2"]
    assert request_work.main([*common, "--after-tenants", "--before-tenants", "--output", str(tmp_path / "both")]) == 0
    assert request_work.main([*common, "--after-tenants", "--output", str(tmp_path / "after")]) == 0
    for name, before_has_them in (("both", True), ("after", False)):
        report = json.loads((tmp_path / name / "request-work.json").read_text())
        assert report["before_tenants"] is before_has_them
        for mode in ("stream", "whole"):
            files = {side: report["modes"][mode][side]["by_file"] for side in ("before", "after")}
            assert files["after"].get("server/gateway/tenants/quota.py", 0) > 0
            assert (files["before"].get("server/gateway/tenants/quota.py", 0) > 0) is before_has_them
    title = (tmp_path / "both" / "request-work.md").read_text().splitlines()[0]
    assert "both with tenants" in title
