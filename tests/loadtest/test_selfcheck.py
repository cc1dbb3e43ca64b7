"""`python -m loadtest.selfcheck`: every configuration at every level, joined and written out."""

import json

from loadtest import selfcheck


def test_selfcheck_runs_every_configuration_and_keeps_earlier_labels(standin, tmp_path, capsys):
    common = ["--url", standin, "--output", str(tmp_path), "--concurrency", "2", "--requests-per-stream", "1"]
    common += ["--min-requests", "4", "--rate", "20", "--rate-seconds", "0.2", "--seed", "3"]
    assert selfcheck.main([*common, "--label", "before", "--gc", "default"]) == 0
    assert selfcheck.main([*common, "--label", "after", "--gc", "default,frozen"]) == 0
    document = json.loads((tmp_path / "overhead.json").read_text())
    assert list(document["labels"]) == ["before", "after"]
    rows = document["labels"]["after"]["rows"]
    # one row per level (closed loop 2, open loop 20/s) and GC mode, the modes back to back
    assert sorted((r["load"]["concurrency"] or 0, r["load"]["rate"] or 0, r["gc"]) for r in rows) == [
        (0, 20.0, "default"),
        (0, 20.0, "frozen"),
        (2, 0, "default"),
        (2, 0, "frozen"),
    ]
    for row in rows:
        assert row["failed"] == 0 and row["requests"] == 4
        assert row["joined_requests"] == row["requests"]  # every request found in the engine's timings
        assert row["median_added_ttft_ms"] > 0
        assert row["median_engine_ttft_ms"] >= 29.0  # the stand-in's TTFT is 30 ms
        assert "gc_pause_max_ms" in row and "client_run_queue_wait_share" in row
        assert isinstance(row["warnings"], list)
    text = (tmp_path / "overhead.md").read_text()
    assert "## before" in text and "## after" in text
    assert "| raw | frozen | 2 |" in text and "| raw | default | 2 |" in text
    assert "| raw | frozen | 20 |" in text
    assert "wrote" in capsys.readouterr().out


def test_selfcheck_rejects_an_unknown_gc_mode(capsys):
    try:
        selfcheck.main(["--url", "http://127.0.0.1:1", "--label", "x", "--gc", "off"])
    except SystemExit as exc:
        assert exc.code == 2
    else:
        raise AssertionError("an unknown GC mode was accepted")
    assert "GC modes are frozen, default" in capsys.readouterr().err
