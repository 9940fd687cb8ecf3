"""The cluster's view on the gateway's HTTP ``GET /metrics``: vLLM's queue and KV series summed over
the schedulers the gateway streams from, so a vLLM dashboard pointed at the one URL vLLM has (the
OpenAI port's ``/metrics``) sees them.

The schedulers own these series (``services/common/metrics.py``); the gateway reads them with
``GetStats`` on each scheduler whose stream is open (``SchedulerDiscovery.connected_links``: one
link per live scheduler id) when scraped. A worker is counted once even when two schedulers list it
(a takeover in progress). The gateway's ``--metrics-port`` serves its own series only, so a
Prometheus that scrapes every service's metrics port still counts each series once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

import grpc
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily

from services.common.metrics import kv_cache_usage, queue_gauges
from services.common.pb import engine_pb2 as pb
from services.gateway.scheduler_link import SchedulerLink

log = logging.getLogger("pagedserve.gateway")

STATS_TIMEOUT_S = 1.0
"""How long a scrape waits for each scheduler's ``GetStats``, seconds; one that does not answer is
left out of that scrape."""


async def _stats(link: SchedulerLink) -> pb.SchedulerStats | None:
    try:
        return await link.stub.GetStats(pb.GetStatsRequest(), timeout=STATS_TIMEOUT_S)
    except grpc.RpcError as exc:
        log.debug("scheduler %s did not give its stats for /metrics: %s", link.scheduler_id, exc.code())
        return None


async def schedulers_stats(links: Iterable[SchedulerLink]) -> list[pb.SchedulerStats]:
    """``GetStats`` of every one of ``links`` at once (those that answer within ``STATS_TIMEOUT_S``)."""
    replies = await asyncio.gather(*(_stats(link) for link in links))
    return [stats for stats in replies if stats is not None]


def cluster_gauges(stats: list[pb.SchedulerStats], model_name: str) -> list[GaugeMetricFamily]:
    """``vllm:num_requests_running``, ``vllm:num_requests_waiting`` (sums over ``stats``) and
    ``vllm:kv_cache_usage_perc`` (0..1, over the distinct workers of ``stats``)."""
    workers = {w.worker_id: w for s in stats for w in s.workers}
    return queue_gauges(sum(s.num_running for s in stats), sum(s.num_waiting for s in stats),
                        kv_cache_usage(workers.values()), model_name)


class _Families:
    """A collector yielding families made beforehand (one scrape's)."""

    def __init__(self, families: list[GaugeMetricFamily]) -> None:
        self._families = families

    def collect(self) -> list[GaugeMetricFamily]:
        return self._families


async def render_cluster_view(links: Iterable[SchedulerLink], model_name: str) -> bytes:
    """The cluster gauges of the schedulers behind ``links``, in Prometheus' text format."""
    registry = CollectorRegistry()
    registry.register(_Families(cluster_gauges(await schedulers_stats(links), model_name)))
    return generate_latest(registry)
