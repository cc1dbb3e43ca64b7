"""A tenant's finished request booked once: the reporter's tenant hook, cached tokens from either
usage dialect, and the `gateway_tenant_*` counters on a fresh registry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from server.gateway.observability.metrics import GatewayMetrics
from server.gateway.observability.record import RequestRecord, RequestReporter, cached_count


def test_cached_tokens_from_chat_and_responses_usage_and_nothing_when_absent():
    assert cached_count({"prompt_tokens_details": {"cached_tokens": 32}}) == 32
    assert cached_count({"input_tokens_details": {"cached_tokens": 16}}) == 16
    assert cached_count({"prompt_tokens_details": None}) == 0  # vLLM without --enable-prompt-tokens-details
    assert cached_count({"prompt_tokens_details": {"cached_tokens": -1}}) == 0
    assert cached_count({}) == 0


def test_the_reporter_books_a_tenants_request_and_only_a_tenants():
    registry = CollectorRegistry()
    metrics = GatewayMetrics(registry)
    booked: list[tuple] = []
    reporter = RequestReporter(metrics, None, lambda *args: booked.append(args))
    record = RequestRecord("r1", "chat", 0.0, status=200, tenant="planner")
    reporter.open(record, "tiny")
    record.usage = {"prompt_tokens": 40, "completion_tokens": 5, "prompt_tokens_details": {"cached_tokens": 32}}
    reporter.finish(record)
    anonymous = RequestRecord("r2", "chat", 0.0, status=200)
    reporter.open(anonymous, "tiny")
    reporter.finish(anonymous)
    refused = RequestRecord("r3", "chat", 0.0, status=403, tenant="planner")  # before a served model was known
    reporter.finish(refused)
    assert booked == [("planner", "tiny", 200, 40, 32, 5), ("planner", "_unknown", 403, 0, 0, 0)]


def test_the_tenant_counters_count_by_tenant_model_and_code():
    registry = CollectorRegistry()
    metrics = GatewayMetrics(registry)
    metrics.tenant_usage("planner", "tiny", 200, 40, 32, 5)
    metrics.tenant_usage("planner", "tiny", 200, 10, 0, 1)
    metrics.tenant_usage("planner", "tiny", 429, 0, 0, 0)

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {"tenant": "planner", "model": "tiny", **labels})

    assert value("gateway_tenant_requests_total", code="200") == 2
    assert value("gateway_tenant_requests_total", code="429") == 1
    assert value("gateway_tenant_prompt_tokens_total") == 50
    assert value("gateway_tenant_cached_prompt_tokens_total") == 32
    assert value("gateway_tenant_completion_tokens_total") == 6


def test_a_records_tokens_are_read_once_and_again_when_its_usage_changes():
    record = RequestRecord("r3", "chat", 0.0)
    assert record.tokens() == (None, None, 0)
    record.usage = {"prompt_tokens": 10, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 8}}
    first = record.tokens()
    assert first == (10, 3, 8)
    assert record.tokens() is first  # the same reading
    record.usage = {"input_tokens": 4, "output_tokens": -1}  # Responses' names; a count no engine would send
    assert record.tokens() == (4, None, 0)
