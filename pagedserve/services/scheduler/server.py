"""Runs the scheduler process: Redis reader thread, scheduler loop thread, gRPC service."""

from __future__ import annotations

import logging
import threading
import uuid
from concurrent import futures

import grpc

from pagedserve.engine.scheduler import Scheduler
from pagedserve.services.common import telemetry
from pagedserve.services.common.auth import CLUSTER_TOKEN_KEY, MetadataAuthInterceptor
from pagedserve.services.common.grpc_server import INTERNAL_SERVER_OPTIONS, add_health, bind, set_serving
from pagedserve.services.common.metrics import serve_metrics
from pagedserve.services.common.pb import engine_pb2, engine_pb2_grpc
from pagedserve.services.common.redis_wait import connect_redis
from pagedserve.services.common.signed_records import RecordCheck
from pagedserve.services.scheduler.cluster import ClusterWatch
from pagedserve.services.scheduler.config import SchedulerServiceConfig
from pagedserve.engine.config import Placement
from pagedserve.services.scheduler.leases import Leases
from pagedserve.services.scheduler.prefix_index import PrefixIndex
from pagedserve.services.scheduler.request_reader import RequestReader
from pagedserve.services.scheduler.loop import SchedulerLoop
from pagedserve.services.scheduler.redis_io import RedisWrites
from pagedserve.services.scheduler.queue_consumer import RequestQueueConsumer
from pagedserve.services.scheduler.service import SchedulerServicer
from pagedserve.services.scheduler.worker_registry import WorkerRegistry

log = logging.getLogger("pagedserve.scheduler")

SCHEDULER_SERVICE = engine_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name
"""Its health status is the scheduler's readiness: SERVING while at least one worker is up."""


def serve_scheduler(config: SchedulerServiceConfig, stop: threading.Event) -> None:
    """Serves until ``stop`` is set. Unfinished requests stay pending in Redis for the next start.

    Raises:
        ConnectionError: Redis did not answer at start.
        OSError: the port cannot be bound.
    """
    tracer = telemetry.setup_tracing("pagedserve-scheduler")
    client = connect_redis(config.redis_url, stop)
    # Records from Redis that fail the cluster token's check are counted in the loop's metrics (made below).
    check = RecordCheck(config.cluster_token, lambda kind: loop.metrics.record_refused(kind))
    consumer = RequestQueueConsumer(client, config.consumer_name, check)
    consumer.ensure_group()
    auth = MetadataAuthInterceptor(CLUSTER_TOKEN_KEY, config.cluster_token, "cluster token")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=64), interceptors=[auth], options=INTERNAL_SERVER_OPTIONS)
    health = add_health(server)
    set_serving(health, False, SCHEDULER_SERVICE)  # until a worker is admitted
    leases = Leases(client, config.consumer_name, uuid.uuid4().hex, config.lease_ttl_s)
    index = PrefixIndex(client, config.consumer_name, config.policy.block_size, config.lease_ttl_s,
                        config.cluster_token)
    loop = SchedulerLoop(config, Scheduler(config.policy, config.speculative_config),
                         RedisWrites(consumer.ack, leases.hand_off), tracer,
                         set_ready=lambda ready: set_serving(health, ready, SCHEDULER_SERVICE))
    engine_pb2_grpc.add_SchedulerServicer_to_server(SchedulerServicer(loop), server)
    port = bind(server, config.host, config.port)
    metrics_server = serve_metrics(loop.metrics.registry, config.host, config.metrics_port, "scheduler")
    server.start()
    watch = ClusterWatch(client, leases, WorkerRegistry(client, check), check,
                         f"{config.advertise_host}:{port}", config.lease_ttl_s, loop.submit, threading.Event(),
                         consumer.ack, loop.has_workers.is_set, index, loop.cached_load)
    reader = RequestReader(consumer, loop, watch, leases,
                           index if config.policy.placement is Placement.PREFIX else None)
    threads = [
        threading.Thread(target=loop.run, args=(stop,), name="scheduler-loop", daemon=True),
        threading.Thread(target=reader.run, args=(stop,), name="request-reader",
                         daemon=True),
        threading.Thread(target=watch.run, args=(config.worker_poll_interval_s, stop), name="cluster-watch",
                         daemon=True),
        threading.Thread(target=loop.redis_writes.run, args=(stop,), name="redis-writes", daemon=True),
    ]
    for thread in threads:
        thread.start()
    set_serving(health, True)
    log.info("scheduler %s listening on %s:%d, reachable at %s:%d", config.consumer_name, config.host, port,
             config.advertise_host, port)
    stop.wait()
    set_serving(health, False)
    for thread in threads:
        thread.join(timeout=10)
    server.stop(grace=2).wait()
    if metrics_server is not None:
        metrics_server.stop()
    telemetry.shutdown_tracing()
    if loop.error is not None:
        raise RuntimeError("the scheduler loop failed") from loop.error
