"""The command line end to end against the stand-in: outputs, A/B, progress, exit codes."""

import io
import json
import subprocess
import sys

import httpx
import pytest

from loadtest.cli import EXIT_NOTHING_COMPLETED, EXIT_OK, EXIT_SLO_MISSED, main
from loadtest.progress import Progress
from loadtest.records import RequestRecord
from tests.support import free_port

FAST = ["--model", "standin", "--max-tokens", "4", "--progress", "plain"]


def test_defaults_write_every_output(standin, tmp_path, capsys):
    out = tmp_path / "run"
    code = main(
        [
            "--url",
            standin + "/v1",
            "--scenario",
            "itinerary",
            "--turns",
            "3",
            "--num-requests",
            "6",
            "--output",
            str(out),
            *FAST,
        ]
    )
    assert code == EXIT_OK
    records = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert len(records) == 6 and all(r["error_kind"] is None for r in records)
    summary = json.loads((out / "summary.json").read_text())
    run = summary["runs"][0]
    assert run["summary"]["completed"] == 6 and run["load"]["concurrency"] == 4
    assert run["summary"]["median_ttft_ms"] >= 30  # the stand-in's 30 ms to first token
    assert summary["config"]["scenario"] == "itinerary"
    report = (out / "report.md").read_text()
    assert "TTFT median (ms)" in report and "## Per turn" in report
    for png in ("ttft.png", "itl.png", "latency_over_time.png", "turns.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    printed = capsys.readouterr().out
    assert "[A: concurrency 4] 6/6 requests" in printed and "wrote" in printed


def test_slo_miss_gives_exit_code_1(standin, tmp_path):
    args = ["--url", standin, "--scenario", "random", "--input-chars", "40", "--num-requests", "4", "--no-plots", *FAST]
    assert main([*args, "--slo", "ttft:5ms", "--output", str(tmp_path / "a")]) == EXIT_SLO_MISSED
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert summary["passed"] is False and summary["runs"][0]["slo"]["slo_attainment"] == 0
    assert main([*args, "--slo", "ttft:5s", "--slo", "e2e:10s", "--output", str(tmp_path / "b")]) == EXIT_OK


def test_errors_count_against_the_slo(standin, tmp_path):
    httpx.post(f"{standin}/_standin/faults", json={"status": 503, "times": 2})
    args = [
        "--url",
        standin,
        "--scenario",
        "random",
        "--input-chars",
        "40",
        "--concurrency",
        "1",
        "--num-requests",
        "4",
        "--no-plots",
        "--slo",
        "ttft:5s",
        *FAST,
    ]
    assert main([*args, "--output", str(tmp_path / "x")]) == EXIT_SLO_MISSED
    summary = json.loads((tmp_path / "x" / "summary.json").read_text())["runs"][0]["summary"]
    assert summary["errors"]["http_503"] == 2 and summary["slo_attainment"] == 0.5


def test_nothing_completed_gives_exit_code_3(tmp_path):
    code = main(
        [
            "--url",
            f"http://127.0.0.1:{free_port()}",
            "--scenario",
            "random",
            "--num-requests",
            "2",
            "--no-plots",
            "--output",
            str(tmp_path),
            *FAST,
        ]
    )
    assert code == EXIT_NOTHING_COMPLETED


def test_compare_sweep_and_ratios(standin, tmp_path):
    out = tmp_path / "ab"
    # B is the same server under another name: the ratios must come out near 1
    code = main(
        [
            "--url",
            standin,
            "--compare",
            standin + "/v1/",
            "--scenario",
            "articles",
            "--num-prompts",
            "6",
            "--concurrency",
            "1,2",
            "--no-plots",
            "--compare-header",
            "x-variant: b",
            "--label-a",
            "fast",
            "--label-b",
            "same",
            "--output",
            str(out),
            *FAST,
        ]
    )
    assert code == EXIT_OK
    summary = json.loads((out / "summary.json").read_text())
    assert [(r["target"], r["load"]["concurrency"]) for r in summary["runs"]] == [
        ("fast", 1),
        ("same", 1),
        ("fast", 2),
        ("same", 2),
    ]
    assert len(summary["comparisons"]) == 2
    ratio = summary["comparisons"][0]["ratios_b_over_a"]["median_ttft_ms"]
    assert 0.5 < ratio < 2.0  # same server, same workload
    assert "## A/B comparison" in (out / "report.md").read_text()
    sessions = [json.loads(line)["session_id"] for line in (out / "requests.jsonl").read_text().splitlines()]
    assert sessions[:6] == sessions[6:12]  # A and B sent the same prompts


def test_open_loop_rate_from_the_command_line(standin, tmp_path):
    code = main(
        [
            "--url",
            standin,
            "--scenario",
            "random",
            "--rate",
            "50",
            "--arrival",
            "gamma",
            "--burstiness",
            "0.5",
            "--concurrency",
            "8",
            "--num-requests",
            "10",
            "--warmup",
            "2",
            "--no-plots",
            "--output",
            str(tmp_path),
            *FAST,
        ]
    )
    assert code == EXIT_OK
    summary = json.loads((tmp_path / "summary.json").read_text())["runs"][0]
    assert summary["load"]["rate"] == 50 and summary["warmup_requests"] == 2
    assert summary["summary"]["completed"] == 10


@pytest.mark.parametrize(
    "bad",
    [
        ["--slo", "itl:5ms"],
        ["--concurrency", "0"],
        ["--scenario", "file"],
        ["--warmup", "xs"],
        ["--rate", "1,2", "--concurrency", "1,2"],
    ],
)
def test_bad_arguments_exit_2(bad, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--url", "http://127.0.0.1:1", "--model", "m", *bad])
    assert exc.value.code == 2


def test_help_runs_as_a_module():
    result = subprocess.run([sys.executable, "-m", "loadtest", "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    for word in ("--concurrency", "--slo", "--compare", "itinerary", "exit codes"):
        assert word in result.stdout


async def test_progress_plain_lines_when_not_a_terminal():
    import asyncio

    stream = io.StringIO()
    progress = Progress(stream=stream, mode="auto", plain_interval_s=0.01)
    assert progress.mode == "plain"
    progress.start("A: concurrency 1", 2)
    progress.update(RequestRecord(request_id="1", ttft_s=0.2))
    progress.update(RequestRecord(request_id="2", error_kind="timeout"))
    await asyncio.sleep(0.05)
    await progress.stop()
    lines = stream.getvalue().splitlines()
    assert len(lines) >= 2 and "\r" not in stream.getvalue()
    assert "2/2 requests" in lines[-1] and "TTFT p50 200 ms" in lines[-1]
    assert "errors 1" in lines[-1]


def test_paired_compare_mode(standin, tmp_path):
    code = main(
        [
            "--url",
            standin,
            "--compare",
            standin,
            "--compare-mode",
            "paired",
            "--scenario",
            "random",
            "--input-chars",
            "40",
            "--concurrency",
            "2",
            "--num-requests",
            "6",
            "--no-plots",
            "--output",
            str(tmp_path),
            *FAST,
        ]
    )
    assert code == EXIT_OK
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [r["summary"]["completed"] for r in summary["runs"]] == [6, 6]
    comparison = summary["comparisons"][0]
    assert comparison["mode"] == "paired"
    assert comparison["per_prompt_differences_b_minus_a"]["pairs"] == 6


@pytest.mark.parametrize("client", ["raw", "httpx"])
def test_engine_timings_give_the_load_testers_own_added_time(standin, tmp_path, capsys, client):
    out = tmp_path / client
    code = main(
        [
            "--url",
            standin,
            "--scenario",
            "random",
            "--input-chars",
            "40",
            "--concurrency",
            "2",
            "--num-requests",
            "6",
            "--no-plots",
            "--http-client",
            client,
            "--engine-timings-url",
            f"{standin}/_standin/timings",
            "--output",
            str(out),
            *FAST,
        ]
    )
    assert code == EXIT_OK
    summary = json.loads((out / "summary.json").read_text())["runs"][0]["summary"]
    assert summary["joined_requests"] == 6 and summary["unjoined_requests"] == 0
    # TTFT as the load tester saw it = the engine's TTFT + the added time, request by request
    assert 0 < summary["median_added_ttft_ms"] < summary["median_ttft_ms"]
    assert summary["median_send_leg_ms"] > 0 and summary["median_receive_leg_ms"] > 0
    assert "p99_loop_lag_ms" in summary and "generator_warnings" in summary
    assert "added TTFT" in (out / "report.md").read_text()
