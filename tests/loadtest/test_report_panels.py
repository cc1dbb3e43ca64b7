"""What `make loadtest`'s report shows: a panel only where there is data (and the report says
which were left out and why), KV-cache usage as the 0..1 ratio vLLM and the gateway export, and
the gateway's /metrics understood as well as an engine's."""

from __future__ import annotations

import matplotlib
import pytest

from loadtest.engine_probe import parse_metrics
from loadtest.plots import left_out, write_plots
from loadtest.records import RequestRecord
from loadtest.report import RunOutcome, markdown
from loadtest.runner import LoadShape, RunResult


def record(turn: int, *, ok: bool = True, kv: float | None = None) -> RequestRecord:
    return RequestRecord(
        request_id=f"r{turn}",
        turn=turn,
        sent_s=0.1 * turn,
        prompt_tokens=100,
        cached_tokens=50,
        ttft_s=0.01,
        e2e_s=0.02,
        error_kind=None if ok else "http",
        engine={"vllm:kv_cache_usage_perc": kv} if kv is not None else None,
    )


def run(records: list[RequestRecord], samples: list | None = None) -> RunResult:
    engine = {"samples": samples} if samples else {}
    return RunResult("gateway", "concurrency 1", LoadShape(concurrency=1), records, wall_s=1.0, engine=engine)


def report(result: RunResult, tmp_path) -> str:
    names = write_plots([result], tmp_path)
    outcome = RunOutcome.of(result, "http://127.0.0.1:8000", {})
    return markdown([outcome], [], {"command": "python -m loadtest"}, names, left_out=left_out([result]))


def test_without_engine_metrics_and_errors_the_report_says_which_panels_were_left_out(tmp_path):
    text = report(run([record(0), record(1), record(2)]), tmp_path)
    assert "Left out of the plots, for want of data:" in text
    assert "KV-cache usage: no engine metrics were sampled" in text
    assert "failed requests per turn: none failed" in text
    assert "KV-cache usage (%)" not in text and "max KV-cache usage" not in text  # no empty column either
    assert {"turns.png", "latency_over_time.png"} <= {p.name for p in tmp_path.iterdir()}


def test_kv_cache_usage_is_reported_as_the_ratio_it_is(tmp_path):
    samples = [(0.0, 0.25, 1, 0), (0.1, 0.5, 1, 0)]
    text = report(run([record(0, kv=0.25), record(1, kv=0.5, ok=False)], samples), tmp_path)
    assert "max KV-cache usage (0..1)" in text and "| 0.500 |" in text
    assert "Left out of the plots" not in text


def test_the_panels_drawn_are_only_those_with_data(tmp_path, monkeypatch):
    drawn = []
    real = matplotlib.figure.Figure.savefig

    def spy(fig, path, *args, **kwargs):
        drawn.append(
            (str(path).rsplit("/", 1)[-1], [ax.get_ylabel() for ax in fig.axes], [ax.get_ylim() for ax in fig.axes])
        )
        return real(fig, path, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", spy)
    write_plots([run([record(0), record(1)])], tmp_path)
    labels = dict((name, ylabels) for name, ylabels, _ in drawn)
    assert labels["turns.png"] == ["median TTFT (ms)", "prompt tokens (sum)"]
    assert labels["latency_over_time.png"] == ["TTFT (ms)", "E2E latency (ms)"]

    drawn.clear()
    write_plots([run([record(0, kv=0.3), record(1, ok=False, kv=0.6)], [(0.0, 0.3, 1, 0)])], tmp_path)
    by_name = {name: (ylabels, limits) for name, ylabels, limits in drawn}
    ylabels, limits = by_name["turns.png"]
    assert ylabels[2:] == ["failed requests", "max KV-cache usage (0..1)"]
    assert limits[3] == (0.0, 1.0) and limits[2][0] == 0
    assert by_name["latency_over_time.png"][0][2] == "KV-cache usage (0..1)"


@pytest.mark.parametrize(
    "text",
    [
        'vllm:kv_cache_usage_perc{engine="0"} 0.4\nvllm:num_requests_running 3\nvllm:prefix_cache_hits_total 7\n',
        'gateway_engine_kv_cache_usage_ratio{model="tiny",engine="a:1"} 0.4\n'
        'gateway_engine_kv_cache_usage_ratio{model="tiny",engine="b:2"} 0.1\n'
        'gateway_engine_requests_running{model="tiny",engine="a:1"} 2\n'
        'gateway_engine_requests_running{model="tiny",engine="b:2"} 1\n'
        'gateway_engine_prefix_cache_hits_total{model="tiny",engine="a:1"} 7\n',
    ],
    ids=["engine", "gateway"],
)
def test_an_engine_s_or_the_gateway_s_metrics_give_the_same_figures(text):
    values = parse_metrics(text)
    assert values["vllm:kv_cache_usage_perc"] == 0.4  # the fullest engine: a ratio is not summed
    assert values["vllm:num_requests_running"] == 3
    assert values["vllm:prefix_cache_hits_total"] == 7
