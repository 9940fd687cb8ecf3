"""The gateway's Prometheus series: what its clients see.

Ownership (see ``pagedserve/services/common/metrics.py``): the gateway owns the latencies its clients
experience and the tokens it hands them: TTFT, inter-token latency, e2e latency, finished samples
by finish reason, prompt and generation tokens, its requests in flight, and the requests it moved
to another scheduler (``pagedserve_gateway_requests_migrated_total``), and the records from Redis it
refused (``pagedserve_redis_records_refused_total``). Queue, prefill and
decode times, KV usage and preemptions are the scheduler's: nothing here counts them. With several
gateways, each counts only its own calls, so sums over gateways count every token once.

Counting follows vLLM, whose ``n`` samples are child requests: each sample is observed on its own
(its TTFT, its inter-token gaps, its e2e latency, its finish reason, and the prompt's tokens once
per sample, when the sample's first token arrives). ``vllm:generation_tokens`` counts the tokens
the clients received (the usage's ``completion_tokens``). A call that fails or whose client goes
away before a sample finishes counts that sample's finish as ``abort``.

Serving: :meth:`GatewayMetrics.render` gives the body and Content-Type of ``GET /metrics`` for an
HTTP server in the gateway's process; ``--metrics-port`` serves the same registry on a port of its
own.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pagedserve.engine.messages import FinishReason
from pagedserve.text.output_processor import TextDelta
from pagedserve.services.common.metrics import (
    INTER_TOKEN_BUCKETS_S, MODEL_NAME, REQUEST_LATENCY_BUCKETS_S, TTFT_BUCKETS_S, new_registry, refused_records_counter,
    render,
)
from pagedserve.services.common.signed_records import RecordKind


class GatewayMetrics:
    """One gateway process's registry (thread-safe; updated from the event loop).

    Args:
        model_name: the served model's name (the ``model_name`` label).
        in_flight: the number of calls in flight now (read on scrape).
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(self, model_name: str, in_flight: Callable[[], int] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.registry: CollectorRegistry = new_registry()
        self.clock = clock
        r, labels = self.registry, [MODEL_NAME]
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              labels, registry=r, buckets=TTFT_BUCKETS_S).labels(model_name)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             labels, registry=r, buckets=INTER_TOKEN_BUCKETS_S).labels(model_name)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             labels, registry=r, buckets=REQUEST_LATENCY_BUCKETS_S).labels(model_name)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", labels,
                                     registry=r).labels(model_name)
        self.generation_tokens = Counter("vllm:generation_tokens", "Number of generation tokens processed.", labels,
                                         registry=r).labels(model_name)
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          [MODEL_NAME, "finished_reason"], registry=r)
        self.success = {reason: success.labels(model_name, reason.value) for reason in FinishReason}
        self.requests_migrated = Counter(
            "pagedserve_gateway_requests_migrated", "Requests this gateway resumed on another scheduler (answered "
            "resume queries the scheduler confirmed; a request that moves twice counts twice).", labels,
            registry=r).labels(model_name)
        self._refused = refused_records_counter(r)
        self._model_name = model_name
        if in_flight is not None:
            Gauge("pagedserve_gateway_requests_in_flight", "Generate calls this gateway is serving now.", labels,
                  registry=r).labels(model_name).set_function(lambda: float(in_flight()))

    def record_refused(self, kind: RecordKind) -> None:
        """Counts a record from Redis that failed the cluster token's check."""
        self._refused.labels(self._model_name, kind.value).inc()

    def start_request(self) -> RequestMetrics:
        """A tracker for one call, its clock started now (call when the call arrives)."""
        return RequestMetrics(self, self.clock())

    def render(self) -> tuple[bytes, str]:
        """``GET /metrics``: (body, Content-Type) in Prometheus' text format."""
        return render(self.registry)


class RequestMetrics:
    """Observes one call's deltas (call from the call's task only)."""

    def __init__(self, metrics: GatewayMetrics, arrived: float) -> None:
        self._metrics = metrics
        self._arrived = arrived
        self._last_token: dict[int, float] = {}  # sample index -> when its latest token reached the gateway
        self._num_finished = 0

    def delta(self, sample_index: int, delta: TextDelta, num_prompt_tokens: int) -> None:
        """Records what one delta of sample ``sample_index`` hands the client."""
        m, now = self._metrics, self._metrics.clock()
        if delta.token_ids:
            last = self._last_token.get(sample_index)
            if last is None:
                m.ttft.observe(now - self._arrived)
                m.prompt_tokens.inc(num_prompt_tokens)
            else:
                m.itl.observe(now - last)
            self._last_token[sample_index] = now
            m.generation_tokens.inc(len(delta.token_ids))
        if delta.finish_reason is not None:
            m.success[delta.finish_reason].inc()
            m.e2e.observe(now - self._arrived)
            self._num_finished += 1

    def aborted(self, num_samples: int) -> None:
        """The call ended before all of its ``num_samples`` samples finished (the client left, or
        it failed): each unfinished sample counts as finished with reason ``abort``, as vLLM counts
        aborted requests."""
        self._metrics.success[FinishReason.ABORT].inc(max(0, num_samples - self._num_finished))
