"""What the gateway itself measures about requests, exported for Prometheus under `gateway_`.

The gateway calls these methods on the hot path, so each model's labelled children are looked
up once and cached: a call is a dict lookup plus one `observe`/`inc`. Inter-token latencies,
one per streamed chunk, cost less still: the relay appends each to its model's list of pending
values (`inter_token_sink(model)` is that list's `append`, looked up once per request: no Python
call per chunk), and the list is folded into the histogram when a request of that model
finishes and before every collection, sorted once and counted per bucket by bisection (a few
increments per request instead of a Python loop over the buckets and two locked increments per
chunk, which multiprocess files make dearer). Times are seconds measured
with `time.perf_counter()` by the caller.

Two families are labelled by endpoint (the name in request.endpoints) instead of model:
`gateway_endpoint_requests_total{endpoint, code}` and
`gateway_endpoint_time_to_first_token_seconds{endpoint}`, so chat, Responses, embeddings and the
rest can be told apart without multiplying every model series by every endpoint.

Streaming and non-streaming requests are never mixed: time to first token exists only for
streaming requests, and `gateway_request_duration_seconds` carries a `stream` label, so a
non-streaming request's full-response time can never be mistaken for a first-token time.

Every `request_started(model)` must be matched by exactly one `request_finished(model, ...)`,
otherwise `gateway_requests_in_flight` drifts.

With several gateway processes (server.gateway.serving), each is created with `multiprocess_dir`:
its metrics then live in prometheus-client's per-process files there (the process must have had
PROMETHEUS_MULTIPROC_DIR set before prometheus_client was imported), none is registered on
`registry`, and `registry` exposes the sums over every process, dead ones included for counters
and histograms, live ones only for `gateway_requests_in_flight`. Collectors added to `registry`
later (the engines' figures) are this process's own. `gateway_worker_restarts_total{worker}`
is the supervisor's: it counts the workers it replaced in a file of that directory
(WORKER_RESTARTS_FILE), which every worker's registry reads when scraped (`WorkerRestarts`).
"""

from __future__ import annotations

import json
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, Metric

from server.gateway.observability.tenant_metrics import TenantCounters

# Seconds. From a few milliseconds (a small model, a warm prefix cache) to minutes (a long prompt
# queued behind others on a busy engine); finer where SLOs usually sit (100 ms - 2 s).
TTFT_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0,
)  # fmt: skip
# Seconds between two streamed content chunks: sub-millisecond (chunks the engine batched) to
# seconds (an engine stalled by preemption or a long prefill of another request).
ITL_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
    0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
# Seconds an event loop woke late: a healthy loop is under a millisecond; a few milliseconds is a
# busy one; a quarter of a second and more is a stall every stream of the process felt.
LOOP_LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
# Seconds for a whole request: 50 ms (an error, a tiny completion) to 30 minutes (the gateway's
# default total timeout).
DURATION_BUCKETS = (
    0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 45.0,
    60.0, 90.0, 120.0, 180.0, 300.0, 600.0, 1200.0, 1800.0,
)  # fmt: skip

# Model names come from clients. Past this many distinct values, further ones are counted under
# OTHER_MODEL so that a client cannot grow the label set without bound.
MAX_MODELS = 64
OTHER_MODEL = "_other"

# In the multiprocess directory: {"worker index": restarts}, written (whole, by rename) by the
# supervisor of `--workers N` (server.gateway.serving.supervisor), which answers no scrape itself.
WORKER_RESTARTS_FILE = "worker-restarts.json"


def _observe(histogram: Histogram, amount: float) -> None:
    """`histogram.observe(amount)` for a labelled child, with one C bisect instead of its Python loop over
    the buckets (and its per-call checks): the same sum and bucket (le: the first bound >= amount)."""
    histogram._sum.inc(amount)
    bounds = histogram._upper_bounds
    index = bisect_left(bounds, amount)
    if index < len(bounds) and amount <= bounds[index]:  # (never false but for NaN, as in observe)
        histogram._buckets[index].inc(1)


@dataclass(slots=True)
class _ModelSeries:
    """The labelled children of one model, looked up once."""

    label: str  # the model label value (OTHER_MODEL past the cap)
    ttft: Histogram
    itl: Histogram
    duration_stream: Histogram
    duration_plain: Histogram
    in_flight: Gauge
    prompt_tokens: Counter
    completion_tokens: Counter
    trimmed_messages: Counter
    trimmed_tokens: Counter
    requests: dict[int, Counter]  # by status code, filled on first use
    # Inter-token latencies observed and not yet in `itl` (relays hold this list's `append`: the
    # list itself is never replaced).
    itl_values: list[float] = field(default_factory=list)

    def flush_itl(self) -> None:
        """Fold the pending inter-token latencies into the histogram (its own buckets, not cumulative)."""
        values = self.itl_values
        if not values:
            return
        values.sort()
        buckets = self.itl._buckets  # prometheus-client's per-bucket values; tests/metrics check the result
        count = len(values)
        below = 0  # values counted into the buckets so far
        # From the smallest value's bucket (le: the first bound >= it) until every value is counted:
        # a stream's latencies fill a bucket or two of the 21, not all of them.
        index = bisect_left(ITL_BUCKETS, values[0])
        while below < count and index < len(ITL_BUCKETS):
            upto = bisect_right(values, ITL_BUCKETS[index], below)  # a value equal to the bound is in its bucket
            if upto > below:
                buckets[index].inc(upto - below)
                below = upto
            index += 1
        if below < count:
            buckets[len(ITL_BUCKETS)].inc(count - below)  # +Inf
        self.itl._sum.inc(sum(values))
        values.clear()


class _FlushBeforeCollect:
    """Registered first: folds every model's pending inter-token latencies before a collection."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        self.metrics.flush()
        return iter(())

    def describe(self) -> Iterator[Metric]:
        return iter(())


class WorkerRestarts:
    """`gateway_worker_restarts_total{worker}`: the workers the supervisor replaced, as its file says.

    A collector over a value someone else owns (the supervisor), read at each collection: a file
    missing or half-written (never, with the supervisor's rename) exports no sample, not an error."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def collect(self) -> Iterator[Metric]:
        try:
            counts = json.loads(self.path.read_text())
        except (OSError, ValueError):
            counts = {}
        family = CounterMetricFamily(
            "gateway_worker_restarts",
            "Worker processes of --workers N replaced by the supervisor after they died, by worker index.",
            labels=["worker"],
        )
        if isinstance(counts, dict):
            for worker, restarts in sorted(counts.items()):
                if isinstance(restarts, int):
                    family.add_metric([str(worker)], float(restarts))
        yield family

    def describe(self) -> Iterator[Metric]:
        return iter(())


class GatewayMetrics:
    """The gateway's request metrics, on its own registry (a fresh one when none is given)."""

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        max_models: int = MAX_MODELS,
        multiprocess_dir: str | None = None,
    ):
        self.registry = registry if registry is not None else CollectorRegistry()
        self._max_models = max_models
        self._models: dict[str, _ModelSeries] = {}
        reg: CollectorRegistry | None = self.registry
        self.registry.register(_FlushBeforeCollect(self))
        if multiprocess_dir is not None:
            from prometheus_client import multiprocess, values

            if not getattr(values.ValueClass, "_multiprocess", False):
                raise RuntimeError(
                    "multiprocess metrics need PROMETHEUS_MULTIPROC_DIR set before prometheus_client loads"
                )
            multiprocess.MultiProcessCollector(self.registry, path=multiprocess_dir)  # type: ignore[no-untyped-call]
            self.registry.register(WorkerRestarts(Path(multiprocess_dir) / WORKER_RESTARTS_FILE))
            reg = None  # the files are the truth; registered here too, this process would count twice
        self._ttft = Histogram(
            "gateway_time_to_first_token_seconds",
            "Streaming requests only: from the request's arrival at the gateway to the first content token leaving it.",
            ["model"],
            buckets=TTFT_BUCKETS,
            registry=reg,
        )
        self._itl = Histogram(
            "gateway_inter_token_latency_seconds",
            "Streaming requests only: time between two consecutive content chunks sent to the client.",
            ["model"],
            buckets=ITL_BUCKETS,
            registry=reg,
        )
        self._duration = Histogram(
            "gateway_request_duration_seconds",
            "From the request's arrival to the end of its response (last byte of a stream, or "
            'the whole body); stream="false" is the full-response time of non-streaming '
            "requests.",
            ["model", "stream"],
            buckets=DURATION_BUCKETS,
            registry=reg,
        )
        self._requests = Counter(
            "gateway_requests",
            "Requests answered, by model and HTTP status code.",
            ["model", "code"],
            registry=reg,
        )
        self._in_flight = Gauge(
            "gateway_requests_in_flight",
            "Requests received and not yet finished.",
            ["model"],
            registry=reg,
            multiprocess_mode="livesum",  # several processes: the sum over the living ones
        )
        self._prompt_tokens = Counter(
            "gateway_prompt_tokens",
            "Prompt tokens reported in the engines' usage.",
            ["model"],
            registry=reg,
        )
        self._completion_tokens = Counter(
            "gateway_completion_tokens",
            "Completion tokens reported in the engines' usage.",
            ["model"],
            registry=reg,
        )
        self._trimmed_messages = Counter(
            "gateway_trimmed_messages",
            "Chat messages dropped by history trimming to fit the model's context.",
            ["model"],
            registry=reg,
        )
        self._trimmed_tokens = Counter(
            "gateway_trimmed_tokens",
            "Prompt tokens removed by history trimming.",
            ["model"],
            registry=reg,
        )
        self._endpoint_requests = Counter(
            "gateway_endpoint_requests",
            "Requests answered, by endpoint (chat, responses, embeddings, ...) and HTTP status code.",
            ["endpoint", "code"],
            registry=reg,
        )
        self._endpoint_ttft = Histogram(
            "gateway_endpoint_time_to_first_token_seconds",
            "Streaming requests only, by endpoint: from arrival to the first token leaving the gateway "
            "(chat: content; Responses: the first response.*.delta event).",
            ["endpoint"],
            buckets=TTFT_BUCKETS,
            registry=reg,
        )
        self._by_endpoint: dict[tuple[str, int], Counter] = {}
        self._ttft_by_endpoint: dict[str, Histogram] = {}
        self._routing = Counter(
            "gateway_routing_decisions",
            "Replicas chosen, by model and by what decided (cache_aware: the scorer that gave the winner "
            "its lead, e.g. prefix, balance, outstanding; or tie, only_choice, load_bound; other "
            "policies: affinity, least_outstanding, round_robin).",
            ["model", "reason"],
            registry=reg,
        )
        self._by_reason: dict[tuple[str, str], Counter] = {}
        self._tenants = TenantCounters(reg)
        self._loop_lag = Histogram(
            "gateway_event_loop_lag_seconds",
            "How late the gateway's event loop woke for a timer (every 0.1 s): a blocked loop delays "
            "every stream of that process by as much (observability.loop_watch).",
            buckets=LOOP_LAG_BUCKETS,
            registry=reg,
        )

    def _series(self, model: str) -> _ModelSeries:
        series = self._models.get(model)
        if series is not None:
            return series
        if len(self._models) >= self._max_models:
            model = OTHER_MODEL
            series = self._models.get(model)
            if series is not None:
                return series
        series = _ModelSeries(
            label=model,
            ttft=self._ttft.labels(model),
            itl=self._itl.labels(model),
            duration_stream=self._duration.labels(model, "true"),
            duration_plain=self._duration.labels(model, "false"),
            in_flight=self._in_flight.labels(model),
            prompt_tokens=self._prompt_tokens.labels(model),
            completion_tokens=self._completion_tokens.labels(model),
            trimmed_messages=self._trimmed_messages.labels(model),
            trimmed_tokens=self._trimmed_tokens.labels(model),
            requests={},
        )
        self._models[model] = series
        return series

    def request_started(self, model: str) -> None:
        """A request for `model` arrived (after its model is known)."""
        self._series(model).in_flight._value.inc(1)  # (the child's value itself, as _observe: one call, not three)

    def request_finished(self, model: str, code: int, duration_s: float, streamed: bool) -> None:
        """A request ended with HTTP status `code` after `duration_s` seconds."""
        series = self._series(model)
        series.flush_itl()
        series.in_flight._value.inc(-1)
        counter = series.requests.get(code)
        if counter is None:
            counter = series.requests[code] = self._requests.labels(series.label, str(code))
        counter._value.inc(1)
        _observe(series.duration_stream if streamed else series.duration_plain, duration_s)

    def first_token(self, model: str, seconds: float) -> None:
        """A streaming request's first content token left the gateway `seconds` after arrival."""
        _observe(self._series(model).ttft, seconds)

    def inter_token(self, model: str, seconds: float) -> None:
        """`seconds` passed between two content chunks of one stream (kept now, exported at the end
        of a request of `model` or at the next collection)."""
        self._series(model).itl_values.append(seconds)

    def inter_token_sink(self, model: str) -> Callable[[float], None]:
        """`inter_token` for one model, as a plain `append` of its pending values (a stream's relay
        looks it up once and calls it per chunk)."""
        return self._series(model).itl_values.append

    def flush(self) -> None:
        """Every pending inter-token latency into its histogram (done before each collection)."""
        for series in self._models.values():
            series.flush_itl()

    def endpoint_request(self, endpoint: str, code: int) -> None:
        """A request to `endpoint` (a name from the endpoint table, so a bounded set) ended with `code`."""
        counter = self._by_endpoint.get((endpoint, code))
        if counter is None:
            counter = self._by_endpoint[endpoint, code] = self._endpoint_requests.labels(endpoint, str(code))
        counter._value.inc(1)

    def endpoint_first_token(self, endpoint: str, seconds: float) -> None:
        histogram = self._ttft_by_endpoint.get(endpoint)
        if histogram is None:
            histogram = self._ttft_by_endpoint[endpoint] = self._endpoint_ttft.labels(endpoint)
        _observe(histogram, seconds)

    def routing_decision(self, model: str, reason: str) -> None:
        """A request for `model` went to the replica `reason` decided (a bounded set of names)."""
        label = self._series(model).label
        counter = self._by_reason.get((label, reason))
        if counter is None:
            counter = self._by_reason[label, reason] = self._routing.labels(label, reason)
        counter._value.inc(1)

    def usage(self, model: str, prompt_tokens: int, completion_tokens: int) -> None:
        """Token counts from an engine's `usage` object."""
        series = self._series(model)
        if prompt_tokens > 0:  # (Counter.inc refuses a negative amount; callers pass sane counts)
            series.prompt_tokens._value.inc(prompt_tokens)
        if completion_tokens > 0:
            series.completion_tokens._value.inc(completion_tokens)

    def tenant_usage(self, tenant: str, model: str, status: int, prompt: int, cached: int, completion: int) -> None:
        """One request of `tenant` (a configured name: a bounded set) for `model` ended with `status`."""
        self._tenants.count(tenant, self._series(model).label, status, prompt, cached, completion)

    def loop_lag(self, seconds: float) -> None:
        """The event loop woke `seconds` later than its timer asked."""
        _observe(self._loop_lag, seconds)

    def trimmed(self, model: str, messages: int, tokens: int) -> None:
        """History trimming dropped `messages` messages worth `tokens` prompt tokens."""
        series = self._series(model)
        if messages:
            series.trimmed_messages.inc(messages)
        if tokens:
            series.trimmed_tokens.inc(tokens)
