"""Prometheus plumbing shared by the services: registries, bucket boundaries, the ``/metrics`` server.

Every process keeps its series in a registry of its own (never prometheus_client's global
default one), so that services started in one test process stay independent and each exposes
only what it owns. Which process owns which series (one owner per piece of state, so nothing is
counted twice across processes):

- gateway (``pagedserve/services/gateway/metrics.py``): what its clients see: ``vllm:time_to_first_token_seconds``,
  ``vllm:inter_token_latency_seconds``, ``vllm:e2e_request_latency_seconds``,
  ``vllm:request_success_total{finished_reason}``, ``vllm:prompt_tokens_total``,
  ``vllm:generation_tokens_total``, ``pagedserve_gateway_requests_in_flight``.
- scheduler (``pagedserve/services/scheduler/metrics.py``): queues and KV blocks: ``vllm:num_requests_running``,
  ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``, ``vllm:prefix_cache_queries_total``,
  ``vllm:prefix_cache_hits_total``, ``vllm:num_preemptions_total``, ``vllm:request_queue_time_seconds``,
  ``vllm:request_prefill_time_seconds``, ``vllm:request_decode_time_seconds``, with speculative decoding
  ``vllm:spec_decode_num_drafts_total``, ``..._num_draft_tokens_total``, ``..._num_accepted_tokens_total``,
  ``..._num_accepted_tokens_per_pos_total{position}``, and ``pagedserve_plan_bytes``,
  ``pagedserve_redis_stream_length``, ``pagedserve_worker_kv_cache_usage_perc``.
- worker (``pagedserve/services/worker/metrics.py``): ``pagedserve_worker_step_seconds{worker}``.
- gateway and scheduler: ``pagedserve_redis_records_refused_total{kind}`` (``refused_records_counter``):
  each counts the records from Redis it refused itself (``pagedserve/services/common/signed_records.py``).

Every series has the ``model_name`` label, as vLLM's do.

The gateway's HTTP ``GET /metrics`` (the one URL vLLM has) adds the cluster's view to its own
series: ``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc`` and
the engine counters (prefix cache, preemptions, ``vllm:spec_decode_*``) over its schedulers' ``GetStats``
(``pagedserve/services/gateway/cluster_metrics.py``); its ``--metrics-port`` does not, so
scraping every service's metrics port counts each series once.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from threading import Thread
from typing import Any
from wsgiref.simple_server import WSGIServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from pagedserve.engine.config import SchedulerStats
from pagedserve.options import option
from pagedserve.services.common.grpc_server import host_port

log = logging.getLogger("pagedserve.metrics")

MODEL_NAME = "model_name"
"""The label every series carries (vLLM's name for it)."""

# vLLM's bucket boundaries (vllm/v1/metrics/loggers.py), seconds.
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                  20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
INTER_TOKEN_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                         20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                             120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
"""vLLM's buckets of e2e latency and of the queue, prefill and decode times."""

# pagedserve's own series.
STEP_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0,
                  10.0, 30.0)
PLAN_BYTES_BUCKETS = tuple(float(256 * 4 ** i) for i in range(9))  # 256 B .. 16 MiB


QUEUE_GAUGES = (("vllm:num_requests_running", "Number of requests in model execution batches."),
                ("vllm:num_requests_waiting", "Number of requests waiting to be processed."),
                ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."))
"""(name, help) of the gauges of running requests, waiting requests and KV-cache usage: the
schedulers' own, and the sums the gateway's HTTP ``/metrics`` offers (``gateway/cluster_metrics.py``)."""


def queue_gauges(running: float, waiting: float, kv_usage: float, model_name: str) -> list[GaugeMetricFamily]:
    """The ``QUEUE_GAUGES`` families with these values (requests running and waiting, KV-cache usage
    0..1), labelled with ``model_name``."""
    families = []
    for (name, doc), value in zip(QUEUE_GAUGES, (running, waiting, kv_usage)):
        family = GaugeMetricFamily(name, doc, labels=[MODEL_NAME])
        family.add_metric([model_name], value)
        families.append(family)
    return families


class MonotonicTotals:
    """Counter totals that only go up, read from sums that may drop: a scheduler's prefix-cache counts
    are sums over the workers it has now, the gateway's over the schedulers that answered. Per
    ``(source, name)`` only increases are added, so a source missing from one reading adds nothing
    twice when it comes back, and a restarted one (a new source id) adds from zero. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: dict[tuple[str, str], int] = {}
        self._totals: dict[str, int] = {}

    def add(self, source: str, name: str, value: int) -> None:
        """Takes ``source``'s current cumulative ``value`` of counter ``name``."""
        with self._lock:
            last = self._last.get((source, name), 0)
            self._totals[name] = self._totals.get(name, 0) + max(0, value - last)
            self._last[(source, name)] = value

    def total(self, name: str) -> int:
        with self._lock:
            return self._totals.get(name, 0)


ENGINE_COUNTERS = (
    ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
     lambda s: s.prefix_cache_queries),
    ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", lambda s: s.prefix_cache_hits),
    ("vllm:num_preemptions", "Cumulative number of preemption from the engine.", lambda s: s.num_preemptions),
)
SPEC_DECODE_COUNTERS = (
    ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", lambda c: c.num_drafts),
    ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", lambda c: c.num_draft_tokens),
    ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", lambda c: c.num_accepted_tokens),
)
SPEC_DECODE_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
"""(name, help, value of a SchedulerStats or SpecDecodeCounters) of vLLM's engine counters (names and
help as vLLM's); the scheduler's ``/metrics`` and the gateway's cluster view both build them with
:func:`engine_counters`."""


def engine_counters(sources: Iterable[tuple[str, SchedulerStats]], totals: MonotonicTotals,
                    model_name: str) -> list[Metric]:
    """vLLM's prefix-cache, preemption and (when some source speculates) ``vllm:spec_decode_*``
    counters over ``sources`` (``(source id, its stats)``), kept monotonic in ``totals``; the
    per-position one has a sample for every draft position any source counts (``0..k-1`` from the start)."""
    sources = list(sources)
    speculating = [(sid, s.spec_decode) for sid, s in sources if s.spec_decode is not None]
    readings = [(name, doc, [(sid, value(s)) for sid, s in sources]) for name, doc, value in ENGINE_COUNTERS]
    readings += [(name, doc, [(sid, value(c)) for sid, c in speculating])
                 for name, doc, value in SPEC_DECODE_COUNTERS if speculating]
    width = max((len(c.num_accepted_tokens_per_pos) for _, c in speculating), default=0)
    families: list[Metric] = []
    for name, doc, values in readings:
        for source, value in values:
            totals.add(source, name, value)
        family = CounterMetricFamily(name, doc, labels=[MODEL_NAME])
        family.add_metric([model_name], totals.total(name))
        families.append(family)
    if speculating:
        per_pos = CounterMetricFamily(SPEC_DECODE_PER_POS, "Accepted tokens per draft position.",
                                      labels=[MODEL_NAME, "position"])
        for position in range(width):
            name = f"{SPEC_DECODE_PER_POS}/{position}"
            for source, counters in speculating:
                accepted = counters.num_accepted_tokens_per_pos
                totals.add(source, name, accepted[position] if position < len(accepted) else 0)
            per_pos.add_metric([model_name, str(position)], totals.total(name))
        families.append(per_pos)
    return families


def kv_cache_usage(workers: Iterable[Any]) -> float:
    """Share of the KV blocks of ``workers`` (each with ``num_blocks`` and ``num_free_blocks``: the
    engine's or protobuf ``WorkerStats``) in use, 0..1 (cached blocks no request holds count as free,
    as in vLLM); 0 without workers."""
    workers = list(workers)
    total = sum(w.num_blocks for w in workers)
    return 0.0 if total == 0 else sum(w.num_blocks - w.num_free_blocks for w in workers) / total


def new_registry() -> CollectorRegistry:
    """An empty registry for one process's series."""
    return CollectorRegistry()


def refused_records_counter(registry: CollectorRegistry) -> Counter:
    """``pagedserve_redis_records_refused_total{model_name, kind}`` in ``registry``: records read
    from Redis that failed the cluster token's check (``signed_records.RecordKind`` values)."""
    return Counter("pagedserve_redis_records_refused", "Records read from Redis that were dropped: not signed "
                   "with this cluster token, undecodable, or stored under another id than their own.",
                   [MODEL_NAME, "kind"], registry=registry)


def render(registry: CollectorRegistry) -> tuple[bytes, str]:
    """The registry in Prometheus' text format: (body, Content-Type header value), ready for an
    HTTP response to ``GET /metrics``."""
    return generate_latest(registry), CONTENT_TYPE_LATEST


@dataclass
class MetricsServer:
    """A running ``/metrics`` HTTP server (prometheus_client's, on a thread of its own)."""

    server: WSGIServer
    thread: Thread

    @property
    def port(self) -> int:
        return self.server.server_port

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def serve_metrics(registry: CollectorRegistry, host: str, port: int | None, service: str) -> MetricsServer | None:
    """Serves ``registry`` at ``http://host:port/metrics`` (port 0 picks a free one; the port is
    logged); ``None`` serves nothing and returns ``None``.

    Raises:
        OSError: the port cannot be bound.
    """
    if port is None:
        return None
    server, thread = start_http_server(port, addr=host, registry=registry)
    running = MetricsServer(server, thread)
    log.info("%s metrics at http://%s/metrics", service, host_port(host, running.port))
    return running


def metrics_port_option() -> Any:
    """The ``metrics_port`` field of a service's config: where it serves Prometheus metrics."""
    return option("serve Prometheus metrics at /metrics on this port of the --host address (0 picks a free "
                  "port, logged at start)", None, metavar="PORT", default_help="no metrics server")


def check_metrics_port(port: int | None) -> None:
    """Raises ValueError unless ``port`` is None or a TCP port (0: a free one)."""
    if port is not None and not 0 <= port < 65536:
        raise ValueError(f"--metrics-port must be in [0, 65535], got {port}")
