"""Engine metrics: parsing a real vLLM 0.32 /metrics page, scraping it onto the Engine, and what the
gateway's /metrics then shows."""

from __future__ import annotations

import socket
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from server.gateway.replicas.collector import EngineCollector
from server.gateway.replicas.engine import Engine, EngineMetrics
from server.gateway.replicas.scraper import EngineMetricsScraper, parse_engine_metrics
from standin import build_app
from tests.support import async_wait_for, serve_in_thread

# Captured from the real engine (vLLM 0.32.0, tiny model) after a few requests, two of them with
# a shared 300-token prompt so the prefix cache had hits. (The dashboard tests read it too.)
VLLM_TEXT = (Path(__file__).resolve().parents[2] / "metrics" / "data" / "vllm-0.32-metrics.txt").read_text()


def scrape(registry: CollectorRegistry) -> dict[tuple[str, frozenset], float]:
    text = generate_latest(registry).decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def engine_labels(engine: str, model: str = "tiny") -> frozenset:
    return frozenset({"model": model, "engine": engine}.items())


def watched(*engines: Engine) -> CollectorRegistry:
    """A fresh registry showing `engines` as the gateway's /metrics does."""
    registry = CollectorRegistry()
    registry.register(EngineCollector(engines))
    return registry


def expected_from_text(text: str, name: str) -> float:
    """The value of an unlabelled-but-for-engine vLLM sample, read independently of our parser."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    raise KeyError(name)


def test_parse_saved_vllm_page():
    snap = parse_engine_metrics(VLLM_TEXT)
    assert snap.kv_usage == expected_from_text(VLLM_TEXT, "vllm:kv_cache_usage_perc")
    assert snap.prefix_queries_tokens == expected_from_text(VLLM_TEXT, "vllm:prefix_cache_queries_total")
    assert snap.prefix_hits_tokens == expected_from_text(VLLM_TEXT, "vllm:prefix_cache_hits_total")
    assert 0 < snap.prefix_hits_tokens < snap.prefix_queries_tokens
    assert snap.running == expected_from_text(VLLM_TEXT, "vllm:num_requests_running")
    assert snap.waiting == expected_from_text(VLLM_TEXT, "vllm:num_requests_waiting")
    assert snap.preemptions == expected_from_text(VLLM_TEXT, "vllm:num_preemptions_total")
    # The dev engine runs with VLLM_CPU_KVCACHE_SPACE=1: 1 GiB / 1024 B per token.
    assert snap.kv_capacity_tokens == 1_048_576


def test_capacity_falls_back_to_blocks_times_block_size():
    text = 'vllm:cache_config_info{block_size="16",num_gpu_blocks="1000",engine="0"} 1.0\n'
    assert parse_engine_metrics(text).kv_capacity_tokens == 16_000
    text = 'vllm:cache_config_info{block_size="16",num_gpu_blocks="None",engine="0"} 1.0\n'
    assert parse_engine_metrics(text).kv_capacity_tokens is None


def test_old_names_are_a_fallback_and_renamed_metrics_are_absent():
    old = (
        "# TYPE vllm:gpu_cache_usage_perc gauge\n"
        'vllm:gpu_cache_usage_perc{model_name="m"} 0.25\n'
        "# TYPE vllm:gpu_prefix_cache_queries counter\n"
        'vllm:gpu_prefix_cache_queries_total{model_name="m"} 10\n'
    )
    snap = parse_engine_metrics(old)
    assert snap.kv_usage == 0.25 and snap.prefix_queries_tokens == 10
    assert snap.running is None and snap.prefix_hits_tokens is None
    # The current name wins when both are present.
    both = old + 'vllm:kv_cache_usage_perc{model_name="m"} 0.5\n'
    assert parse_engine_metrics(both).kv_usage == 0.5
    # A page where everything we know was renamed: nothing, and no error.
    renamed = VLLM_TEXT.replace("vllm:", "vllm_v2:")
    assert parse_engine_metrics(renamed) == EngineMetrics()


def test_data_parallel_ranks_are_summed_and_usage_averaged():
    text = "".join(
        f'vllm:num_requests_running{{engine="{i}"}} {i + 1}\n'
        f'vllm:kv_cache_usage_perc{{engine="{i}"}} {0.2 * (i + 1)}\n'
        f'vllm:cache_config_info{{engine="{i}",kv_cache_size_tokens="100"}} 1\n'
        for i in range(2)
    )
    snap = parse_engine_metrics(text)
    assert snap.running == 3
    assert snap.kv_usage == pytest.approx(0.3)
    assert snap.kv_capacity_tokens == 200


class MetricsPage:
    """What a stand-in engine's /metrics answers: `update(status=..., text=...)` sets it through
    the stand-in's faults (`metrics_status`, `metrics_text`)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.page = {"text": VLLM_TEXT, "status": 200}
        self.update()

    def update(self, **page: object) -> None:
        self.page.update(page)
        faults = {"metrics_text": self.page["text"], "metrics_status": self.page["status"]}
        httpx.post(f"{self.url}/_standin/faults", json=faults, timeout=10).raise_for_status()


@pytest.fixture
def fake_engine():
    """A stand-in engine on loopback answering /metrics with the saved vLLM page, or what the test
    sets with `page.update(status=..., text=...)`."""
    with serve_in_thread(build_app()) as url:
        yield url, MetricsPage(url)


async def test_collector_exports_the_snapshot_and_marks_engine_up(fake_engine):
    url, _ = fake_engine
    engine = Engine("tiny", url, planned_kv_tokens=900_000)
    registry = watched(engine)
    labels = engine_labels(engine.id)
    async with httpx.AsyncClient() as client:
        scraper = EngineMetricsScraper([engine], client=client, interval=60)
        got = scrape(registry)
        # Before the first scrape: down, planned capacity known, nothing from the engine.
        assert got[("gateway_engine_up", labels)] == 0
        assert got[("gateway_engine_kv_cache_planned_tokens", labels)] == 900_000
        assert ("gateway_engine_kv_cache_usage_ratio", labels) not in got
        await scraper.start()
        try:
            await async_wait_for(lambda: engine.metrics_up)
        finally:
            await scraper.aclose()
    got = scrape(registry)
    snap = parse_engine_metrics(VLLM_TEXT)
    expected = {
        "gateway_engine_up": 1,
        "gateway_engine_kv_cache_usage_ratio": snap.kv_usage,
        "gateway_engine_prefix_cache_queries_total": snap.prefix_queries_tokens,
        "gateway_engine_prefix_cache_hits_total": snap.prefix_hits_tokens,
        "gateway_engine_requests_running": snap.running,
        "gateway_engine_requests_waiting": snap.waiting,
        "gateway_engine_preemptions_total": snap.preemptions,
        "gateway_engine_kv_cache_capacity_tokens": 1_048_576,
        "gateway_engine_kv_cache_planned_tokens": 900_000,
    }
    for name, value in expected.items():
        assert got[(name, labels)] == value, name
    assert got[("gateway_engine_last_scrape_timestamp_seconds", labels)] > 1.6e9
    # Nothing of ours carries vLLM's prefix.
    assert not any(name.startswith("vllm") for name, _ in got)


async def test_failed_scrape_marks_down_and_drops_stale_values(fake_engine):
    url, page = fake_engine
    engine = Engine("tiny", url)
    registry = watched(engine)
    labels = engine_labels(engine.id)
    async with httpx.AsyncClient() as client:
        scraper = EngineMetricsScraper([engine], client=client)
        await scraper.scrape_once(engine)
        assert engine.metrics_up
        last_scrape = ("gateway_engine_last_scrape_timestamp_seconds", labels)
        good_time = scrape(registry)[last_scrape]
        broken = 'vllm:num_requests_running{engine="0" 1\n'  # a line we read, not parsable
        for status, text in ((500, "oops"), (200, broken)):
            page.update(status=status, text=text)
            await scraper.scrape_once(engine)  # must not raise
            got = scrape(registry)
            assert got[("gateway_engine_up", labels)] == 0
            assert ("gateway_engine_kv_cache_usage_ratio", labels) not in got
            # The last good scrape's time stays, so "down since" is visible.
            assert got[last_scrape] == good_time
        # A page without any metric we know (all renamed upstream) is an engine that answers:
        # up, with those series absent.
        page.update(status=200, text=VLLM_TEXT.replace("vllm:", "vllm_v2:"))
        await scraper.scrape_once(engine)
        got = scrape(registry)
        assert got[("gateway_engine_up", labels)] == 1
        assert ("gateway_engine_kv_cache_usage_ratio", labels) not in got
        page.update(status=200, text=VLLM_TEXT)
        await scraper.scrape_once(engine)
        assert ("gateway_engine_kv_cache_usage_ratio", labels) in scrape(registry)


async def test_dead_engines_are_marked_down_without_holding_up_others(fake_engine):
    """A refused connection and an engine that accepts but never answers: both end up down, and
    meanwhile the live engine is scraped again and again and the loop serves other requests."""
    url, _ = fake_engine
    refuse = socket.socket()
    refuse.bind(("127.0.0.1", 0))  # bound, never listening: refused, and no other process can serve it
    refused = f"http://127.0.0.1:{refuse.getsockname()[1]}"
    hang = socket.socket()
    hang.bind(("127.0.0.1", 0))
    hang.listen(16)  # never accepted, never answered
    hanging = f"http://127.0.0.1:{hang.getsockname()[1]}"
    live, dead, hung = Engine("tiny", url), Engine("tiny", refused), Engine("tiny", hanging)
    registry = watched(live, dead, hung)
    try:
        async with httpx.AsyncClient() as client:
            # The hanging scrape's timeout far outlasts the wait below, however busy the machine.
            scraper = EngineMetricsScraper([live, dead, hung], client=client, interval=0.05, timeout=300.0)
            await scraper.start()
            try:
                await async_wait_for(lambda: live.scrapes >= 5 and dead.scrape_error is not None)
                # While the hanging engine's first scrape is still outstanding:
                assert hung.scrapes == 1 and hung.scrape_error is None
                for _ in range(3):  # the loop and the client still serve other requests
                    assert (await client.get(url + "/metrics")).status_code == 200
                got = scrape(registry)  # a gateway scrape does no I/O, so it does not wait either
                assert got[("gateway_engine_up", engine_labels(live.id))] == 1
                assert got[("gateway_engine_up", engine_labels(dead.id))] == 0
                assert got[("gateway_engine_up", engine_labels(hung.id))] == 0
                assert hung.scrapes == 1 and hung.scrape_error is None
            finally:
                await scraper.aclose()  # cancels the hanging scrape too
            assert all(task.done() for task in scraper._tasks) and not scraper._tasks
    finally:
        hang.close()
        refuse.close()


async def test_hanging_engine_times_out_to_down():
    hang = socket.socket()
    hang.bind(("127.0.0.1", 0))
    hang.listen(4)
    try:
        engine = Engine("tiny", f"http://127.0.0.1:{hang.getsockname()[1]}")
        registry = watched(engine)
        async with httpx.AsyncClient() as client:
            scraper = EngineMetricsScraper([engine], client=client, interval=0.2, timeout=0.2)
            await scraper.scrape_once(engine)
        assert "Timeout" in engine.scrape_error
        assert scrape(registry)[("gateway_engine_up", engine_labels(engine.id))] == 0
    finally:
        hang.close()


@pytest.mark.engine
async def test_scrape_real_engine(real_engine):
    engine = Engine(real_engine.model, real_engine.url)
    registry = watched(engine)
    async with httpx.AsyncClient() as client:
        scraper = EngineMetricsScraper([engine], client=client)
        await scraper.scrape_once(engine)
    got = scrape(registry)
    labels = engine_labels(engine.id, model=real_engine.model)
    assert got[("gateway_engine_up", labels)] == 1
    assert 0 <= got[("gateway_engine_kv_cache_usage_ratio", labels)] <= 1
    assert got[("gateway_engine_kv_cache_capacity_tokens", labels)] > 0
    for name in (
        "gateway_engine_prefix_cache_queries_total",
        "gateway_engine_prefix_cache_hits_total",
        "gateway_engine_requests_running",
        "gateway_engine_requests_waiting",
        "gateway_engine_preemptions_total",
    ):
        assert (name, labels) in got, name


def test_the_prefill_and_first_token_sums_are_read_and_the_buckets_skipped():
    text = "\n".join(
        [
            "# TYPE vllm:request_prefill_time_seconds histogram",
            'vllm:request_prefill_time_seconds_bucket{engine="0",le="0.01",model_name="m"} 3.0',
            'vllm:request_prefill_time_seconds_sum{engine="0",model_name="m"} 0.25',
            'vllm:request_prefill_time_seconds_count{engine="0",model_name="m"} 9.0',
            "# TYPE vllm:time_to_first_token_seconds histogram",
            'vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 0.5',
            'vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 9.0',
            'vllm:time_to_first_token_seconds_sum{engine="1",model_name="m"} 0.25',
            'vllm:time_to_first_token_seconds_count{engine="1",model_name="m"} 3.0',
        ]
    )
    metrics = parse_engine_metrics(text)
    assert metrics.prefill_seconds == 0.25
    assert metrics.first_token_seconds == 0.75 and metrics.first_tokens == 12.0  # data-parallel ranks summed
    assert parse_engine_metrics("").first_tokens is None
