"""Runs the gateway process: Generation service, health, reflection, the streams of every live
scheduler, and the OpenAI-compatible HTTP API (uvicorn on the same event loop)."""

from __future__ import annotations

import asyncio
import logging
import signal

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pagedserve.services.common import telemetry
from pagedserve.services.common.auth import API_KEY_KEY, AioMetadataAuthInterceptor
from pagedserve.services.common.grpc_server import CLIENT_API_SERVER_OPTIONS, bind, host_port
from pagedserve.services.common.metrics import serve_metrics
from pagedserve.services.common.open_files import raise_open_files_limit
from pagedserve.services.common.redis_pool import async_redis_client
from pagedserve.services.common.pb import engine_pb2, generate_pb2
from pagedserve.services.common.service_args import redact_url
from pagedserve.services.gateway.cluster_metrics import ClusterView
from pagedserve.services.gateway.config import SHUTDOWN_CLOSE_S, GatewayConfig
from pagedserve.services.gateway.drain import DrainingCore
from pagedserve.services.gateway.generation_handler import add_generation_service
from pagedserve.services.gateway.http_app import HealthState, HttpSettings, add_metrics_route, build_http_app
from pagedserve.services.gateway.http_server import EmbeddedUvicorn, listening_socket, new_http_server
from pagedserve.services.gateway.openai_serving import OpenAIServing
from pagedserve.services.gateway.metrics import GatewayMetrics
from pagedserve.services.gateway.queue_producer import RequestQueueProducer
from pagedserve.services.gateway.held_check import HeldCheck
from pagedserve.services.gateway.router import OutputRouter
from pagedserve.services.gateway.service import GenerationServicer
from pagedserve.text.tokenizer import PromptTokenizer

log = logging.getLogger("pagedserve.gateway")

GENERATION_SERVICE = generate_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
SCHEDULER_SERVICE = engine_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name

OTHER_OPEN_FILES = 256
"""File descriptors the gateway needs besides client and Redis connections (scheduler channels,
model files, logs)."""


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


def _http_server(config: GatewayConfig, serving: OpenAIServing, http_health: HealthState,
                 metrics: GatewayMetrics, router: OutputRouter) -> EmbeddedUvicorn:
    app = build_http_app(serving, http_health, HttpSettings(api_key=config.api_key))
    cluster = ClusterView(config.model_name)

    async def render() -> tuple[bytes, str]:
        """The gateway's series and the cluster's view (``cluster_metrics``)."""
        body, content_type = metrics.render()
        return body + await cluster.render(router.discovery.connected_links()), content_type

    add_metrics_route(app, render)
    # TLS: the same certificate as the gRPC port.
    tls = dict(ssl_certfile=str(config.tls_cert_file), ssl_keyfile=str(config.tls_key_file)) if config.tls_cert_file else {}
    return new_http_server(app, config.http_header_timeout_s, config.send_timeout_s, SHUTDOWN_CLOSE_S / 2, tls)


async def _close(server: grpc.aio.Server, http_task: asyncio.Task, router: OutputRouter, tasks: list[asyncio.Task],
                 redis_client) -> None:
    """Stops the gRPC and HTTP servers, lets the calls the ended requests started (Aborts, stream entries'
    deletions) end, then stops the router's tasks (which close the scheduler links), then the Redis pool."""
    await asyncio.gather(server.stop(grace=SHUTDOWN_CLOSE_S / 2), http_task, return_exceptions=True)
    if left := await router.background.settle(SHUTDOWN_CLOSE_S / 4):
        log.warning("%d Abort or clean-up calls still running at shutdown end with the process", left)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await redis_client.aclose()


def _log_started(config: GatewayConfig, port: int, http_port: int, tls: bool) -> None:
    """Logs where the gateway listens, and warns when it serves other machines without an API key."""
    log.info("gateway %s listening on %s (%s, %s), schedulers from Redis %s, model %s", config.gateway_id,
             host_port(config.host, port), "TLS" if tls else "plaintext",
             "API key required" if config.api_key else "no API key", redact_url(config.redis_url), config.model.name)
    log.info("gateway %s OpenAI-compatible HTTP API listening on %s (http_port=%d), model name %r",
             config.gateway_id, host_port(config.host, http_port), http_port, config.model_name)
    if not config.api_key and config.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("listening on %s without an API key: anyone who reaches this port can generate "
                    "(set --api-key-file or PAGEDSERVE_API_KEY)", config.host)


async def _http_started(http_server: EmbeddedUvicorn, http_task: asyncio.Task) -> None:
    """Returns once uvicorn serves the HTTP API.

    Raises:
        Exception: whatever made uvicorn stop before it started.
    """
    while not http_server.started:
        if http_task.done():
            http_task.result()
            raise OSError("the HTTP API stopped before it started (see the log above)")
        await asyncio.sleep(0.01)


async def _until_signalled() -> None:
    """Returns on the first SIGINT or SIGTERM."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


async def _add_health_and_reflection(server: grpc.aio.Server) -> health.aio.HealthServicer:
    """Adds grpc's health service, NOT_SERVING until ``_watch_health`` says ready (grpc's starts
    SERVING), and server reflection; returns the health servicer."""
    health_servicer = health.aio.HealthServicer()
    for name in ("", GENERATION_SERVICE):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((GENERATION_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    return health_servicer


async def serve_gateway(config: GatewayConfig) -> None:
    """Serves until SIGINT or SIGTERM, then drains (``drain.DrainingCore``): within
    ``config.shutdown_grace_s`` plus ``SHUTDOWN_CLOSE_S`` seconds it returns.

    Raises:
        OSError: the port cannot be bound, the model folder has no tokenizer, or a TLS file cannot be read.
    """
    credentials = _server_credentials(config)
    tracer = telemetry.setup_tracing("pagedserve-gateway")
    tokenizer = PromptTokenizer.from_folder(config.model)
    # a file descriptor per client connection (up to one per request) and per pooled Redis connection
    raise_open_files_limit(config.max_concurrent_requests + config.redis_max_connections + OTHER_OPEN_FILES)
    redis_client = async_redis_client(config.redis_url, config.redis_max_connections)
    producer = RequestQueueProducer(redis_client, config.gateway_id, config.cluster_token)
    metrics = GatewayMetrics(config.model_name, lambda: router.num_in_flight)
    router = OutputRouter(redis_client, config.cluster_token, config.gateway_id, metrics.requests_migrated.inc,
                          on_refused=metrics.record_refused)

    server = _new_server(config)
    core = DrainingCore(tokenizer, producer, router, config.max_concurrent_requests, metrics)
    servicer = GenerationServicer(core, tracer, config.tool_call_parser, config.send_timeout_s)
    add_generation_service(servicer, server)  # undecodable bytes: INVALID_ARGUMENT
    health_servicer = await _add_health_and_reflection(server)
    port = bind(server, config.host, config.port, credentials)
    metrics_server = serve_metrics(metrics.registry, config.host, config.metrics_port, "gateway")
    http_health = HealthState()
    http_socket = listening_socket(config.host, config.http_port)
    http_port = http_socket.getsockname()[1]
    serving = OpenAIServing(core, config.model_name, tracer, config.tool_call_parser, config.send_timeout_s)
    http_server = _http_server(config, serving, http_health, metrics, router)
    await server.start()
    if not await producer.ping():
        log.warning("Redis at %s does not answer: requests fail with UNAVAILABLE until it does (health is "
                    "NOT_SERVING meanwhile)", redact_url(config.redis_url))
    tasks = [asyncio.create_task(router.run()), asyncio.create_task(HeldCheck(router).run())]
    http_task = asyncio.create_task(http_server.serve(sockets=[http_socket]))
    await _http_started(http_server, http_task)
    _log_started(config, port, http_port, tls=credentials is not None)
    watch = asyncio.create_task(_watch_health(health_servicer, router, producer, http_health))  # ready from here
    tasks.append(watch)
    await _until_signalled()
    watch.cancel()  # from now on NOT_SERVING
    await health_servicer.enter_graceful_shutdown()
    http_health.serving = False
    await core.drain(config.shutdown_grace_s)
    log.info("gateway %s drained; closing", config.gateway_id)
    http_server.should_exit = True
    try:  # the bound this function promises, whatever a link or a Redis connection waits for
        async with asyncio.timeout(SHUTDOWN_CLOSE_S):
            await _close(server, http_task, router, tasks, redis_client)
    except TimeoutError:
        log.warning("gateway %s: closing its connections took over %g s; exiting anyway", config.gateway_id,
                    SHUTDOWN_CLOSE_S)
    http_socket.close()
    if metrics_server is not None:
        metrics_server.stop()
    telemetry.shutdown_tracing()
    log.info("gateway %s stopped", config.gateway_id)
