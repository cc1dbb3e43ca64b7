"""Short real runs: the tiny vLLM engine directly, and through the gateway (as a subprocess)."""

import json
import os
import signal
import subprocess
import sys

import pytest

from loadtest.cli import EXIT_OK, main
from tests.support import free_port, wait_http

pytestmark = pytest.mark.engine


def test_itinerary_against_the_engine(real_engine, tmp_path):
    code = main(
        [
            "--url",
            real_engine.url,
            "--model",
            real_engine.model,
            "--scenario",
            "itinerary",
            "--turns",
            "3",
            "--concurrency",
            "2",
            "--num-requests",
            "6",
            "--max-tokens",
            "16",
            "--metrics-url",
            real_engine.url + "/metrics",
            "--progress",
            "off",
            "--no-plots",
            "--output",
            str(tmp_path),
        ]
    )
    assert code == EXIT_OK
    records = [json.loads(x) for x in (tmp_path / "requests.jsonl").read_text().splitlines()]
    assert len(records) == 6 and all(r["error_kind"] is None for r in records)
    assert all(r["tokens_from_usage"] and r["completion_tokens"] >= 1 for r in records)
    assert all(r["done"] and r["ttft_s"] <= r["e2e_s"] for r in records)
    # vLLM's own token counts grow with the history, turn by turn
    for session in {r["session_id"] for r in records}:
        tokens = [
            r["prompt_tokens"]
            for r in sorted((r for r in records if r["session_id"] == session), key=lambda r: r["turn"])
        ]
        assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens)
    # the engine's KV cache was sampled while requests were in flight; the tiny model may
    # finish a request between two samples, so not every request sees its own blocks
    summary = json.loads((tmp_path / "summary.json").read_text())["runs"][0]["summary"]
    assert len(summary["engine"]["samples"]) >= 2
    assert any(r["engine"] and r["engine"]["vllm:kv_cache_usage_perc"] > 0 for r in records)
    # the shared system prompt and each session's context are served from the prefix cache
    assert summary["engine"]["prefix_cache_hit_rate"] > 0


@pytest.fixture
def gateway(real_engine):
    port = free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "server",
            "serve",
            "--upstream",
            f"{real_engine.model}={real_engine.url}",
            "--port",
            str(port),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        wait_http(f"http://127.0.0.1:{port}/v1/models", timeout=60)
        yield f"http://127.0.0.1:{port}"
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        process.stderr.close()


def test_articles_through_the_gateway_and_direct(real_engine, gateway, tmp_path):
    code = main(
        [
            "--url",
            gateway + "/v1",
            "--compare",
            real_engine.url,
            "--model",
            real_engine.model,
            "--label-a",
            "gateway",
            "--label-b",
            "direct",
            "--scenario",
            "articles",
            "--num-prompts",
            "6",
            "--concurrency",
            "2",
            "--max-tokens",
            "8",
            "--progress",
            "off",
            "--no-plots",
            "--output",
            str(tmp_path),
        ]
    )
    assert code == EXIT_OK
    summary = json.loads((tmp_path / "summary.json").read_text())
    gateway_run, direct_run = summary["runs"]
    assert gateway_run["summary"]["completed"] == direct_run["summary"]["completed"] == 6
    # same prompts, same engine: the same prompt tokens either way
    assert gateway_run["summary"]["total_input_tokens"] == direct_run["summary"]["total_input_tokens"]
    assert summary["comparisons"][0]["ratios_b_over_a"]["median_ttft_ms"] > 0
