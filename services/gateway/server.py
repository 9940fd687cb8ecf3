"""Runs the gateway process: Generation service, health, reflection, the streams of every live
scheduler, and the OpenAI-compatible HTTP API (uvicorn on the same event loop)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket

import grpc
import redis
import uvicorn
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common import telemetry
from services.common.auth import API_KEY_KEY, AioMetadataAuthInterceptor
from services.common.grpc_server import CLIENT_API_SERVER_OPTIONS, bind
from services.common.metrics import serve_metrics
from services.common.pb import engine_pb2, generate_pb2
from services.common.service_args import redact_url
from services.gateway.config import GatewayConfig
from services.gateway.generation_core import GenerationCore
from services.gateway.generation_handler import add_generation_service
from services.gateway.http_app import HealthState, HttpSettings, add_metrics_route, build_http_app
from services.gateway.openai_serving import OpenAIServing
from services.gateway.metrics import GatewayMetrics
from services.gateway.queue_producer import RequestQueueProducer
from services.gateway.router import OutputRouter
from services.gateway.service import GenerationServicer
from pagedserve.text.tokenizer import PromptTokenizer

log = logging.getLogger("pagedserve.gateway")

GENERATION_SERVICE = generate_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
SCHEDULER_SERVICE = engine_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name


async def _scheduler_ready(channel: grpc.aio.Channel) -> bool:
    """Whether the scheduler behind ``channel`` has a worker up (its Scheduler service's health)."""
    try:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=SCHEDULER_SERVICE), timeout=2.0)
    except grpc.RpcError:
        return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


async def _any_scheduler_ready(router: OutputRouter) -> bool:
    """Whether some scheduler's stream is open and that scheduler has a worker up."""
    for link in router.discovery.connected_links():
        if await _scheduler_ready(link.channel):
            return True
    return False


async def _watch_health(servicer: health.aio.HealthServicer, router: OutputRouter, producer: RequestQueueProducer,
                        http_health: HealthState) -> None:
    """SERVING while at least one scheduler stream is open (to a scheduler with a worker up) and
    Redis answers."""
    while True:
        ok = await _any_scheduler_ready(router) and await producer.ping()
        http_health.serving = ok
        status = health_pb2.HealthCheckResponse.SERVING if ok else health_pb2.HealthCheckResponse.NOT_SERVING
        await servicer.set("", status)
        await servicer.set(GENERATION_SERVICE, status)
        await asyncio.sleep(1.0)


def _server_credentials(config: GatewayConfig) -> grpc.ServerCredentials | None:
    """TLS credentials from the configured PEM files, or None for plaintext.

    Raises:
        OSError: a file cannot be read.
    """
    if config.tls_cert_file is None or config.tls_key_file is None:
        return None
    return grpc.ssl_server_credentials([(config.tls_key_file.read_bytes(), config.tls_cert_file.read_bytes())])


def _new_server(config: GatewayConfig) -> grpc.aio.Server:
    """An asyncio server with the client API's limits, checking the API key when there is one."""
    interceptors = []
    if config.api_key:
        interceptors.append(AioMetadataAuthInterceptor(API_KEY_KEY, f"Bearer {config.api_key}", "API key"))
    return grpc.aio.server(interceptors=interceptors, options=CLIENT_API_SERVER_OPTIONS)


class _EmbeddedUvicorn(uvicorn.Server):
    """uvicorn inside the gateway's event loop: the gateway handles the signals, not uvicorn."""

    def capture_signals(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


def _http_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: a free one).

    Raises:
        OSError: the address cannot be bound.
    """
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    try:
        return socket.create_server((host, port), family=family, backlog=2048)
    except OSError as exc:
        raise OSError(f"cannot listen on {host}:{port} (--http-port): {exc.strerror or exc}") from exc


def _http_server(config: GatewayConfig, serving: OpenAIServing, http_health: HealthState,
                 metrics: GatewayMetrics) -> uvicorn.Server:
    app = build_http_app(serving, http_health, HttpSettings(api_key=config.api_key))
    add_metrics_route(app, metrics.render)
    # TLS: the same certificate as the gRPC port.
    tls = dict(ssl_certfile=str(config.tls_cert_file), ssl_keyfile=str(config.tls_key_file)) if config.tls_cert_file else {}
    uv_config = uvicorn.Config(app, lifespan="off", access_log=False, log_level="warning", timeout_keep_alive=30,
                               timeout_graceful_shutdown=5, **tls)
    return _EmbeddedUvicorn(uv_config)


async def serve_gateway(config: GatewayConfig) -> None:
    """Serves until SIGINT or SIGTERM.

    Raises:
        OSError: the port cannot be bound, the model folder has no tokenizer, or a TLS file cannot be read.
    """
    credentials = _server_credentials(config)
    tracer = telemetry.setup_tracing("pagedserve-gateway")
    tokenizer = PromptTokenizer.from_folder(config.model)
    # Retries reconnect after Redis restarts (a pooled connection to the old server is dead).
    redis_client = aioredis.Redis.from_url(
        config.redis_url, socket_connect_timeout=2, socket_timeout=10, health_check_interval=5,
        retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), retries=5),
        retry_on_error=[redis.ConnectionError, redis.TimeoutError])
    producer = RequestQueueProducer(redis_client, config.gateway_id, config.cluster_token)
    metrics = GatewayMetrics(config.model_name, lambda: router.num_in_flight)
    router = OutputRouter(redis_client, config.cluster_token, config.gateway_id, metrics.requests_migrated.inc,
                          on_refused=metrics.record_refused)

    server = _new_server(config)
    core = GenerationCore(tokenizer, producer, router, config.max_concurrent_requests, metrics)
    servicer = GenerationServicer(core, tracer)
    add_generation_service(servicer, server)  # undecodable bytes: INVALID_ARGUMENT
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (GENERATION_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    port = bind(server, config.host, config.port, credentials)
    metrics_server = serve_metrics(metrics.registry, config.host, config.metrics_port, "gateway")
    http_health = HealthState()
    http_socket = _http_socket(config.host, config.http_port)
    http_port = http_socket.getsockname()[1]
    http_server = _http_server(config, OpenAIServing(core, config.model_name, tracer), http_health, metrics)
    await server.start()
    if not await producer.ping():
        log.warning("Redis at %s does not answer: requests fail with UNAVAILABLE until it does (health is "
                    "NOT_SERVING meanwhile)", redact_url(config.redis_url))
    watch = _watch_health(health_servicer, router, producer, http_health)
    tasks = [asyncio.create_task(router.run()), asyncio.create_task(watch)]
    http_task = asyncio.create_task(http_server.serve(sockets=[http_socket]))
    log.info("gateway %s listening on %s:%d (%s, %s), schedulers from Redis %s, model %s", config.gateway_id,
             config.host, port, "TLS" if credentials else "plaintext",
             "API key required" if config.api_key else "no API key", redact_url(config.redis_url), config.model.name)
    log.info("gateway %s OpenAI-compatible HTTP API listening on %s:%d (http_port=%d), model name %r",
             config.gateway_id, config.host, http_port, http_port, config.model_name)
    if not config.api_key and config.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("listening on %s without an API key: anyone who reaches this port can generate "
                    "(set --api-key-file or PAGEDSERVE_API_KEY)", config.host)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await health_servicer.enter_graceful_shutdown()
    http_health.serving = False
    http_server.should_exit = True
    await asyncio.gather(server.stop(grace=5), http_task, return_exceptions=True)
    http_socket.close()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)  # the router closes its scheduler links
    await redis_client.aclose()
    if metrics_server is not None:
        metrics_server.stop()
    telemetry.shutdown_tracing()
