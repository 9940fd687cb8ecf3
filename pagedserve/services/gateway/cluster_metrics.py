"""The cluster's view on the gateway's HTTP ``GET /metrics``: vLLM's queue and KV gauges and its
engine counters (prefix cache, preemptions, speculative decoding) summed over the schedulers the
gateway streams from, so a vLLM dashboard pointed at the one URL vLLM has (the OpenAI port's
``/metrics``) sees them.

The schedulers own these series (``pagedserve/services/common/metrics.py``); the gateway reads them with
``GetStats`` on each scheduler whose stream is open (``SchedulerDiscovery.connected_links``: one
link per live scheduler id) when scraped. A worker is counted once even when two schedulers list it
(a takeover in progress). Counters are kept per scheduler id (``MonotonicTotals``), so a scheduler
that misses one scrape is not counted twice when it answers again. The gateway's ``--metrics-port`` serves its own series only, so a
Prometheus that scrapes every service's metrics port still counts each series once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

import grpc
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric

from pagedserve.engine.config import SchedulerStats
from pagedserve.services.common.convert import stats_from_pb
from pagedserve.services.common.metrics import MonotonicTotals, engine_counters, kv_cache_usage, queue_gauges
from pagedserve.services.common.pb import engine_pb2 as pb
from pagedserve.services.gateway.scheduler_link import SchedulerLink

log = logging.getLogger("pagedserve.gateway")

STATS_TIMEOUT_S = 1.0
"""How long a scrape waits for each scheduler's ``GetStats``, seconds; one that does not answer is
left out of that scrape."""


async def _stats(link: SchedulerLink) -> tuple[str, SchedulerStats] | None:
    try:
        reply = await link.stub.GetStats(pb.GetStatsRequest(), timeout=STATS_TIMEOUT_S)
    except grpc.RpcError as exc:
        log.debug("scheduler %s did not give its stats for /metrics: %s", link.scheduler_id, exc.code())
        return None
    return link.scheduler_id, stats_from_pb(reply)


async def schedulers_stats(links: Iterable[SchedulerLink]) -> list[tuple[str, SchedulerStats]]:
    """``(scheduler id, GetStats)`` of every one of ``links`` at once (those that answer within
    ``STATS_TIMEOUT_S``)."""
    replies = await asyncio.gather(*(_stats(link) for link in links))
    return [reply for reply in replies if reply is not None]


def cluster_gauges(stats: list[SchedulerStats], model_name: str) -> list[GaugeMetricFamily]:
    """``vllm:num_requests_running``, ``vllm:num_requests_waiting`` (sums over ``stats``) and
    ``vllm:kv_cache_usage_perc`` (0..1, over the distinct workers of ``stats``)."""
    workers = {w.worker_id: w for s in stats for w in s.workers}
    return queue_gauges(sum(s.num_running for s in stats), sum(s.num_waiting for s in stats),
                        kv_cache_usage(workers.values()), model_name)


class _Families:
    """A collector yielding families made beforehand (one scrape's)."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> list[Metric]:
        return self._families


class ClusterView:
    """The gateway's cluster series; one per gateway (it keeps the counters' totals between scrapes).

    Args:
        model_name: the ``model_name`` label.
    """

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self._totals = MonotonicTotals()

    def families(self, sources: list[tuple[str, SchedulerStats]]) -> list[Metric]:
        """The gauges and counters over ``sources`` (``(scheduler id, its stats)``)."""
        return [*cluster_gauges([s for _, s in sources], self.model_name),
                *engine_counters(sources, self._totals, self.model_name)]

    async def render(self, links: Iterable[SchedulerLink]) -> bytes:
        """The series of the schedulers behind ``links``, in Prometheus' text format."""
        registry = CollectorRegistry()
        registry.register(_Families(self.families(await schedulers_stats(links))))
        return generate_latest(registry)
