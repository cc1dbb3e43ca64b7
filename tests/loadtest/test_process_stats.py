"""Where the load generator's time went: CPU, run-queue wait, GC pauses; the GC frozen in a run."""

import gc
import os

import pytest

from loadtest import scenarios
from loadtest.client import ChatClient, make_transport
from loadtest.loop_lag import Limits, saturation
from loadtest.process_stats import GCPauses, ProcessSample, frozen_gc
from loadtest.report import RunOutcome, markdown
from loadtest.runner import LoadShape, Runner, StopRule

linux = pytest.mark.skipif(not os.path.exists("/proc/self/schedstat"), reason="reads /proc (Linux)")


def test_shares_between_two_samples():
    before = ProcessSample(at_s=10.0, cpu_s=1.0, run_queue_wait_s=0.5)
    after = ProcessSample(at_s=12.0, cpu_s=2.5, run_queue_wait_s=1.1)
    shares = after.since(before)
    assert shares["cpu_share"] == pytest.approx(0.75)
    assert shares["run_queue_wait_share"] == pytest.approx(0.3)
    unknown = ProcessSample(at_s=12.0, cpu_s=None, run_queue_wait_s=None).since(before)
    assert unknown == {"cpu_share": None, "run_queue_wait_share": None}
    assert after.since(after) == {"cpu_share": None, "run_queue_wait_share": None}  # no time passed


@linux
def test_this_process_cpu_time_grows_while_it_works():
    before = ProcessSample.take()
    assert before.cpu_s is not None and before.run_queue_wait_s is not None
    work = 0
    while ProcessSample.take().cpu_s == before.cpu_s:  # clock ticks: poll, never time
        work += sum(range(10_000))
    assert ProcessSample.take().cpu_s > before.cpu_s


def test_a_process_that_does_not_exist_gives_no_figures():
    sample = ProcessSample.take(pid=2**22 + 12345)
    assert sample.cpu_s is None and sample.run_queue_wait_s is None


def test_gc_pauses_count_collections_until_stopped():
    pauses = GCPauses()
    pauses.start()
    gc.collect()
    gc.collect(0)
    stats = pauses.stop()
    assert stats["gc_collections"] >= 2
    assert stats["gc_full_collections"] >= 1
    assert stats["gc_pause_max_ms"] > 0 and stats["gc_pause_total_ms"] >= stats["gc_pause_max_ms"]
    young, _, full = stats["gc_pause_max_ms_by_generation"]
    assert full > 0 and young > 0 and max(stats["gc_pause_max_ms_by_generation"]) == stats["gc_pause_max_ms"]
    gc.collect()  # after stop(): not counted any more
    assert pauses.stop()["gc_collections"] == stats["gc_collections"]


def test_frozen_gc_freezes_in_the_block_only_and_nests():
    assert gc.get_freeze_count() == 0
    with frozen_gc():
        frozen = gc.get_freeze_count()
        assert frozen > 0
        with frozen_gc():  # the inner block keeps the outer freeze
            assert gc.get_freeze_count() >= frozen
        assert gc.get_freeze_count() >= frozen
    assert gc.get_freeze_count() == 0
    with frozen_gc(enabled=False):
        assert gc.get_freeze_count() == 0


@pytest.mark.parametrize("freeze", [True, False])
async def test_runner_freezes_the_gc_during_a_run_and_reports_its_process(standin, freeze):
    seen = []
    async with make_transport("raw", max_connections=2, timeout_s=10) as http:
        client = ChatClient(standin, http=http, model="standin", timeout_s=10)
        result = await Runner(
            client,
            scenarios.random_prompts(0, input_chars=40, max_tokens=2),
            LoadShape(concurrency=2),
            StopRule(num_requests=4),
            freeze_gc=freeze,
            on_record=lambda record: seen.append(gc.get_freeze_count()),
        ).run()
    assert seen and all((count > 0) == freeze for count in seen)
    assert gc.get_freeze_count() == 0  # unfrozen after the run
    for key in ("generator_cpu_share", "generator_run_queue_wait_share", "gc_collections", "gc_pause_max_ms"):
        assert key in result.process
    summary = RunOutcome.of(result, standin, {}).summary
    assert "generator_run_queue_wait_share" in summary and "gc_pause_max_ms" in summary


def test_busy_machine_warning_above_the_run_queue_limit_only():
    assert saturation({"generator_run_queue_wait_share": 0.10}) == []
    assert saturation({"generator_run_queue_wait_share": None}) == []
    assert saturation({"generator_run_queue_wait_share": float("nan")}) == []
    (warning,) = saturation({"generator_run_queue_wait_share": 0.35})
    assert "machine was busy" in warning and "35%" in warning
    assert saturation({"generator_run_queue_wait_share": 0.35}, limits=Limits(run_queue_wait_share=0.5)) == []


async def test_busy_machine_warning_reaches_the_report(standin):
    async with make_transport("raw", max_connections=1, timeout_s=10) as http:
        client = ChatClient(standin, http=http, model="standin", timeout_s=10)
        result = await Runner(
            client,
            scenarios.random_prompts(0, input_chars=40, max_tokens=2),
            LoadShape(concurrency=1),
            StopRule(num_requests=2),
        ).run()
    result.process["generator_run_queue_wait_share"] = 0.4  # as a busy machine would leave it
    outcome = RunOutcome.of(result, standin, {})
    assert any("machine was busy" in w for w in outcome.summary["generator_warnings"])
    assert "machine was busy" in markdown([outcome], [], {}, [])
