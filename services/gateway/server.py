"""Runs the gateway process: Generation service, health, reflection, the scheduler stream."""

from __future__ import annotations

import asyncio
import logging
import signal

import grpc
import redis.asyncio as aioredis
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common import telemetry
from services.common.grpc_server import SERVER_OPTIONS, bind
from services.common.pb import generate_pb2
from services.gateway.config import GatewayConfig
from services.gateway.generation_handler import add_generation_service
from services.gateway.queue_producer import RequestQueueProducer
from services.gateway.router import OutputRouter
from services.gateway.service import GenerationServicer
from pagedserve.text.tokenizer import PromptTokenizer

log = logging.getLogger("pagedserve.gateway")

GENERATION_SERVICE = generate_pb2.DESCRIPTOR.services_by_name["Generation"].full_name


async def _watch_health(servicer: health.aio.HealthServicer, router: OutputRouter, producer: RequestQueueProducer) -> None:
    """SERVING while the scheduler stream is up and Redis answers."""
    while True:
        ok = router.connected.is_set() and await producer.ping()
        status = health_pb2.HealthCheckResponse.SERVING if ok else health_pb2.HealthCheckResponse.NOT_SERVING
        await servicer.set("", status)
        await servicer.set(GENERATION_SERVICE, status)
        await asyncio.sleep(1.0)


async def serve_gateway(config: GatewayConfig) -> None:
    """Serves until SIGINT or SIGTERM.

    Raises:
        OSError: the port cannot be bound, or the model folder has no tokenizer.
    """
    tracer = telemetry.setup_tracing("pagedserve-gateway")
    tokenizer = PromptTokenizer.from_folder(config.model)
    redis_client = aioredis.Redis.from_url(config.redis_url, socket_connect_timeout=2, socket_timeout=10)
    producer = RequestQueueProducer(redis_client, config.gateway_id)
    channel = grpc.aio.insecure_channel(config.scheduler_address)
    router = OutputRouter(channel, config.gateway_id)

    server = grpc.aio.server(options=SERVER_OPTIONS)
    servicer = GenerationServicer(tokenizer, producer, router, tracer, config.max_concurrent_requests)
    add_generation_service(servicer, server)  # undecodable bytes: INVALID_ARGUMENT
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (GENERATION_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    port = bind(server, config.host, config.port)
    await server.start()
    tasks = [asyncio.create_task(router.run()), asyncio.create_task(_watch_health(health_servicer, router, producer))]
    log.info("gateway %s listening on %s:%d, scheduler %s, model %s", config.gateway_id, config.host, port,
             config.scheduler_address, config.model.name)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await health_servicer.enter_graceful_shutdown()
    await server.stop(grace=5)
    for task in tasks:
        task.cancel()
    await channel.close()
    await redis_client.aclose()
    telemetry.shutdown_tracing()
