"""The flow gate as the proxy meets it: one call before routing (`FlowGate.enter`), one after the
answer (`FlowGate.leave`). It works out what the request is to the gate: its class (the tenant's,
or lower: flow.classes), its cost (the uncached part of its prompt by the prefix index, plus the
output it may write), vLLM's `priority` field when the model's engines schedule by priority; and
it writes the class and the wait into the request's record (the access log line).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial
from time import monotonic, perf_counter

from prometheus_client import CollectorRegistry

from server.config import ServedModel
from server.gateway.flow.classes import PRIORITY_HEADER, VLLM_PRIORITY, Class, request_class
from server.gateway.flow.control import FlowControl, Pass
from server.gateway.flow.metrics import FlowCollector
from server.gateway.observability.record import RequestRecord
from server.gateway.replicas.cache import CHARS_PER_TOKEN, PromptView
from server.gateway.replicas.pool import ModelPool
from server.gateway.request.request import GatewayRequest
from server.gateway.settings import GatewaySettings, worker_count

# Endpoints whose vLLM request takes a `priority` field.
PRIORITY_ENDPOINTS = frozenset({"chat", "completions"})


class FlowGate:
    """The gate for one app: the tenants' classes, the control, the models that take `priority`."""

    def __init__(
        self, control: FlowControl, classes: Mapping[str, Class], priority_models: frozenset[str] = frozenset()
    ) -> None:
        self.control = control
        self.classes = dict(classes)  # tenant -> its class
        self.priority_models = priority_models
        self.chars_per_token: dict[str, float] = {}  # model -> learned from the answers' usage

    def applies(self, request: GatewayRequest, record: RequestRecord) -> bool:
        """Tenants' requests that make an engine work (not GETs of a stored response)."""
        return record.tenant is not None and request.endpoint.method == "POST" and not request.endpoint.fan_out

    def pass_now(self, pool: ModelPool, request: GatewayRequest, record: RequestRecord) -> Pass | None:
        """The request's class (and vLLM's `priority`), and its pass when the model has room
        now: the path of every request while the engines are not full, so no prompt is read
        (the charge is a reservation of its output and of its tenant's recent prompt cost).
        None: it must wait (`wait`)."""
        tenant = record.tenant
        assert tenant is not None
        klass = self.classes.get(tenant, "standard")
        asked = request.header(PRIORITY_HEADER)
        if asked is not None:
            klass = request_class(klass, asked)
        record.priority = klass
        if self.priority_models and pool.name in self.priority_models and request.endpoint.name in PRIORITY_ENDPOINTS:
            request.replace_body({**request.body, "priority": VLLM_PRIORITY[klass]})
        # reserved until the answer settles: its output, and the tenant's recent prompt cost
        # (flow.control.pass_now); the body's size was tried as a prompt estimate and dropped
        # (10-20x the uncached part behind a cached system prompt: docs/operate/flow-control.md)
        control = self.control
        held = control.pass_now(pool, tenant, klass, _output_tokens(request, control))
        if held is not None:
            record.queued_s = 0.0
            request.late_work = partial(control.book, held)  # its charge, made while the engine works
        return held

    async def wait(
        self, pool: ModelPool, request: GatewayRequest, record: RequestRecord, prompt: PromptView | None
    ) -> tuple[Pass, PromptView | None]:
        """Wait for room (flow.control), charged its estimated cost; the prompt view routing is to
        record (one replica too, so the prefix index knows what the engine holds)."""
        tenant, klass = record.tenant, record.priority
        assert tenant is not None and klass in VLLM_PRIORITY
        if prompt is None and request.endpoint.model_from == "json":
            prompt = await pool.cache.read(
                pool.name, request.body, pool.engines, precise=False, adapter=request.adapter
            )
        cost = self._uncached_tokens(pool, prompt) + _output_tokens(request, self.control)
        started = perf_counter()
        try:
            held = await self.control.enter(pool, tenant, klass, cost)  # type: ignore[arg-type]
        finally:
            record.queued_s = perf_counter() - started
        held.chars = prompt.chars if prompt is not None else 0
        return held, prompt

    def leave(self, held: Pass, record: RequestRecord) -> None:
        prompt, completion, cached = record.tokens()
        if prompt and held.chars:
            learned = self.chars_per_token.get(held.model, held.chars / prompt)
            self.chars_per_token[held.model] = learned + 0.2 * (held.chars / prompt - learned)
        self.control.settle(held, prompt, completion, cached)

    def _uncached_tokens(self, pool: ModelPool, prompt: PromptView | None) -> float:
        """The prompt's tokens no healthy replica holds, by the approximate prefix index."""
        if prompt is None:
            return 0.0
        index = pool.cache.approximate
        keys = prompt.text_keys
        matched = max((index.matched(e.id, keys, monotonic()) for e in pool.engines if e.healthy), default=0)
        uncached_chars = max(0, prompt.chars - matched * pool.cache.block_chars)
        return uncached_chars / self.chars_per_token.get(pool.name, CHARS_PER_TOKEN)


def _output_tokens(request: GatewayRequest, control: FlowControl) -> int:
    """The output a request may write, reserved until its usage says: its cap (read on the
    tenant's path: app.proxied), else a default."""
    cap = request.output_cap
    return cap if cap is not None else control.settings.expected_output_tokens


def build_gate(
    settings: GatewaySettings, models: Sequence[ServedModel], registry: CollectorRegistry
) -> FlowGate | None:
    """The app's gate (None without tenants, or with `flow.enabled` off), its metrics on `registry`."""
    if not settings.tenants or not settings.flow.enabled:
        return None
    try:
        workers = worker_count(settings.workers)
    except ValueError:
        workers = 1
    priority_models = frozenset(m.name for m in models if m.priority_scheduling)
    if settings.flow.set_priority is not None:
        priority_models = frozenset(m.name for m in models) if settings.flow.set_priority else frozenset()
    control = FlowControl(
        settings.flow,
        max_num_seqs={m.name: m.max_num_seqs for m in models},
        workers=workers,
        wait_cap=settings.timeouts.first_byte,
        priority_models=priority_models,
    )
    registry.register(FlowCollector(control, [t.name for t in settings.tenants]))
    classes: dict[str, Class] = {t.name: t.priority for t in settings.tenants}
    return FlowGate(control, classes, priority_models)
