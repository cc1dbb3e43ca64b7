"""One replica's state on one object: health bookkeeping, load, and the scraped figures."""

from __future__ import annotations

from server.gateway.replicas.engine import NO_METRICS, Engine, EngineMetrics


def test_engine_health_bookkeeping():
    engine = Engine("m", "http://127.0.0.1:1/")
    assert engine.id == "127.0.0.1:1" and engine.url == "http://127.0.0.1:1"
    assert engine.record_check(False, unhealthy_after=2, healthy_after=2)  # the first check decides
    assert not engine.healthy
    engine.record_check(True, unhealthy_after=2, healthy_after=2)
    assert not engine.healthy
    engine.record_check(True, unhealthy_after=2, healthy_after=2)
    assert engine.healthy
    engine.record_check(False, unhealthy_after=2, healthy_after=2)
    assert engine.healthy
    engine.record_check(False, unhealthy_after=2, healthy_after=2)
    assert not engine.healthy
    engine.healthy = True
    engine.mark_down("refused")
    assert not engine.healthy and engine.last_error == "refused"


def test_record_check_says_when_the_state_changed():
    engine = Engine("m", "http://h:1")
    assert not engine.record_check(True, unhealthy_after=1, healthy_after=1)  # up, and it was up
    assert engine.record_check(False, unhealthy_after=1, healthy_after=1)
    assert not engine.record_check(False, unhealthy_after=1, healthy_after=1)
    assert engine.record_check(True, unhealthy_after=1, healthy_after=1)


def test_a_new_engine_knows_nothing_of_its_figures():
    engine = Engine("m", "http://h:1", planned_kv_tokens=1000)
    assert engine.metrics is NO_METRICS and engine.metrics.kv_usage is None
    assert not engine.metrics_up and engine.scraped_at is None and engine.scrapes == 0
    assert engine.planned_kv_tokens == 1000


def test_a_failed_scrape_drops_the_figures_and_keeps_the_time_of_the_last_good_one():
    engine = Engine("m", "http://h:1")
    figures = EngineMetrics(kv_usage=0.5, waiting=3.0)
    engine.record_scrape(figures, at=100.0)
    assert engine.metrics is figures and engine.metrics_up and engine.scraped_at == 100.0
    engine.record_scrape_failure("ReadTimeout()")
    assert engine.metrics is NO_METRICS and not engine.metrics_up
    assert engine.scraped_at == 100.0 and engine.scrape_error == "ReadTimeout()"
    engine.record_scrape(figures, at=200.0)
    assert engine.scrape_error is None and engine.scraped_at == 200.0


def test_health_and_scraping_are_separate_facts():
    """/health and /metrics are different endpoints: one failing says nothing about the other."""
    down = Engine("m", "http://h:1")
    down.record_scrape(EngineMetrics(kv_usage=0.1), at=1.0)
    down.mark_down("ConnectError")
    assert not down.healthy and down.metrics_up and down.metrics.kv_usage == 0.1
    unscraped = Engine("m", "http://h:2")
    unscraped.record_scrape_failure("boom")
    assert unscraped.healthy and unscraped.last_error is None and unscraped.scrape_error == "boom"
