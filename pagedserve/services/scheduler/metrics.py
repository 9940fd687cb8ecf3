"""The scheduler's Prometheus series: its queues, KV blocks and per-request phase times.

Ownership (see ``pagedserve/services/common/metrics.py``): the scheduler owns what only it knows: running and
waiting requests, KV-cache usage, prefix-cache queries and hits, preemptions, speculative
decoding's drafts and accepted tokens (a snapshot of ``SchedulerStats``, read on scrape), and each
sample's queue, prefill and decode times (it sees a request arrive, be scheduled, and get its
first and last token), plus the plan sizes it sends and the Redis request stream's length. Token
counts, TTFT, ITL, e2e latency and finish reasons are the gateway's: nothing here counts them.

Threads: the engine is touched only by the loop thread. Gauges and cumulative counters come from
the latest ``SchedulerStats`` snapshot the loop publishes (an immutable object), read by a custom
collector on the scrape thread; the histograms are observed by the loop thread itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pagedserve.engine.config import SchedulerStats
from pagedserve.engine.messages import BatchPlan
from pagedserve.engine.outputs import RequestOutput
from pagedserve.services.common.metrics import (
    MODEL_NAME, PLAN_BYTES_BUCKETS, REQUEST_LATENCY_BUCKETS_S, MonotonicTotals, engine_counters, kv_cache_usage,
    new_registry, queue_gauges, refused_records_counter,
)
from pagedserve.services.common.signed_records import RecordKind


class StatsCollector(Collector):
    """Gauges and counters read from the loop's latest snapshot on every scrape.

    Counters are kept monotonic (``MonotonicTotals``): the scheduler's prefix-cache totals are sums
    over the workers it has now, so they drop when a worker goes away; only increases are added.
    ``vllm:spec_decode_*`` series exist only when the scheduler speculates (its stats carry
    ``spec_decode``), as vLLM makes them only with a speculative config.

    Args:
        snapshot: the latest (stats, model name) the loop published (thread-safe to call).
    """

    def __init__(self, snapshot: Callable[[], tuple[SchedulerStats, str]]) -> None:
        self._snapshot = snapshot
        self._totals = MonotonicTotals()

    def collect(self) -> Iterable[Metric]:
        stats, model = self._snapshot()
        yield from queue_gauges(stats.num_running, stats.num_waiting, kv_cache_usage(stats.workers), model)
        yield from engine_counters([("", stats)], self._totals, model)
        per_worker = GaugeMetricFamily("pagedserve_worker_kv_cache_usage_perc",
                                       "KV-cache usage of one worker, 0..1.", labels=[MODEL_NAME, "worker"])
        for w in stats.workers:
            per_worker.add_metric([model, w.worker_id], 0.0 if w.num_blocks == 0 else 1 - w.num_free_blocks / w.num_blocks)
        yield per_worker


@dataclass
class _Times:
    """Monotonic clock readings of one request, seconds; its samples' token times by sample index."""

    queued: float
    scheduled: float | None = None
    first_token: dict[int, float] = field(default_factory=dict)
    last_token: dict[int, float] = field(default_factory=dict)


class SchedulerMetrics:
    """The scheduler process's registry and the loop's hooks into it (call them from the loop thread).

    A sample's phases, as vLLM defines them: queue = first scheduled - arrived at the scheduler;
    prefill = its first token - first scheduled; decode = its last token - its first token. They
    are observed once per sample, when it finishes (n samples: n observations, as vLLM's child
    requests are).

    Args:
        snapshot: the latest (stats, model name) the loop published, for the gauges and counters.
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(self, snapshot: Callable[[], tuple[SchedulerStats, str]],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.registry: CollectorRegistry = new_registry()
        self.registry.register(StatsCollector(snapshot))
        self._snapshot = snapshot
        self._clock = clock
        self._requests: dict[str, _Times] = {}
        labels = [MODEL_NAME]
        self.queue_time = Histogram("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for "
                                    "request.", labels, registry=self.registry, buckets=REQUEST_LATENCY_BUCKETS_S)
        self.prefill_time = Histogram("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase "
                                      "for request.", labels, registry=self.registry, buckets=REQUEST_LATENCY_BUCKETS_S)
        self.decode_time = Histogram("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for "
                                     "request.", labels, registry=self.registry, buckets=REQUEST_LATENCY_BUCKETS_S)
        self.plan_bytes = Histogram("pagedserve_plan_bytes", "Size of one encoded BatchPlan sent to a worker, bytes.",
                                    [MODEL_NAME, "worker"], registry=self.registry, buckets=PLAN_BYTES_BUCKETS)
        self.plans_ahead = Counter("pagedserve_plans_sent_ahead", "BatchPlans sent to a worker before it answered "
                                   "the plan before (overlap scheduling, --max-plans-in-flight 2).",
                                   [MODEL_NAME, "worker"], registry=self.registry)
        self.migrated = Counter("pagedserve_requests_resumed", "Requests this scheduler took over from another "
                                "(or from its own backlog after a restart) and resumed after the tokens their "
                                "clients had received.", labels, registry=self.registry)
        self.forwarded = Counter("pagedserve_requests_forwarded", "New requests this scheduler moved to a peer "
                                 "that caches more of their prompt (the shared index of cached blocks).", labels,
                                 registry=self.registry)
        self.balanced = Counter("pagedserve_requests_balanced", "New requests this scheduler moved to a peer with "
                                "a lighter load (waiting plus running), so that a burst spreads over the schedulers.",
                                labels, registry=self.registry)
        self.recomputed = Counter("pagedserve_resumed_tokens", "Tokens the requests this scheduler resumed had "
                                  "before they moved (prompt and output tokens already received), which it computes "
                                  "again (fewer when its prefix cache holds some).", labels, registry=self.registry)
        self.stream_length = Gauge("pagedserve_redis_stream_length", "Entries in the Redis request stream: requests "
                                   "queued or in flight (an entry is deleted when its request ends).", labels,
                                   registry=self.registry)
        self.refused = refused_records_counter(self.registry)

    @property
    def _model(self) -> str:
        return self._snapshot()[1]

    def request_added(self, request_id: str) -> None:
        self._requests.setdefault(request_id, _Times(self._clock()))

    def plan_sent(self, worker_id: str, plan: BatchPlan, num_ahead: int) -> None:
        """Marks the requests whose first sequence is in ``plan`` as scheduled; counts a plan sent
        while ``num_ahead`` earlier plans of the worker were unanswered."""
        now = self._clock()
        for new in plan.new_requests:
            times = self._requests.get(new.seq_id.request_id)
            if times is not None and times.scheduled is None:
                times.scheduled = now
        if num_ahead:
            self.plans_ahead.labels(self._model, worker_id).inc()

    def observe_plan_size(self, worker_id: str, num_bytes: int) -> None:
        """Observes the encoded size of a plan sent to ``worker_id``, bytes."""
        self.plan_bytes.labels(self._model, worker_id).observe(num_bytes)

    def outputs(self, outputs: Iterable[RequestOutput]) -> None:
        """Notes the samples' token times; observes the phases of samples that finished."""
        now = self._clock()
        for output in outputs:
            times = self._requests.get(output.request_id)
            if times is None:
                continue
            if output.new_token_ids:
                times.first_token.setdefault(output.sample_index, now)
                times.last_token[output.sample_index] = now
            if output.finished:
                self._sample_finished(times, output.sample_index)

    def _sample_finished(self, times: _Times, sample_index: int) -> None:
        first, last = times.first_token.pop(sample_index, None), times.last_token.pop(sample_index, None)
        if times.scheduled is None:
            return  # never scheduled (aborted or failed while waiting)
        model = self._model
        self.queue_time.labels(model).observe(times.scheduled - times.queued)
        if first is not None and last is not None:
            self.prefill_time.labels(model).observe(first - times.scheduled)
            self.decode_time.labels(model).observe(last - first)

    def record_refused(self, kind: RecordKind) -> None:
        """Counts a record from Redis that failed the cluster token's check (any thread)."""
        self.refused.labels(self._model, kind.value).inc()

    def request_forwarded(self) -> None:
        """Counts a new request moved to a peer that caches more of its prompt."""
        self.forwarded.labels(self._model).inc()

    def request_balanced(self) -> None:
        """Counts a new request moved to a peer with a lighter load."""
        self.balanced.labels(self._model).inc()

    def request_migrated(self, num_tokens: int) -> None:
        """Counts one resumed request that had ``num_tokens`` prompt and received output tokens."""
        self.migrated.labels(self._model).inc()
        self.recomputed.labels(self._model).inc(num_tokens)

    def request_closed(self, request_id: str) -> None:
        """Forgets a request none of whose samples is in flight any more."""
        self._requests.pop(request_id, None)
