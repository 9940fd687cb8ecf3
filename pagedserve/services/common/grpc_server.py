"""Building blocks every gRPC service uses: health checking, message-size limits, binding."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc


def add_health(server: grpc.Server | grpc.aio.Server) -> health.HealthServicer:
    """Adds ``grpc.health.v1.Health`` to a server; the overall status starts as NOT_SERVING.

    Works for sync and asyncio servers (the servicer's methods are plain functions).
    """
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    return servicer


def set_serving(servicer: health.HealthServicer, serving: bool, service_name: str = "") -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    servicer.set(service_name, status)


def health_status(target: str, timeout_s: float = 1.0, credentials: grpc.ChannelCredentials | None = None) -> str:
    """The overall status the gRPC server at ``target`` (host:port) answers: ``SERVING``, ``NOT_SERVING``, ...
    (``grpc.health.v1``'s names). ``credentials``: TLS credentials for a server that listens with TLS
    (default: plaintext).

    Raises:
        grpc.RpcError: no health service answered (nothing listens there, or not gRPC, or a deadline).
    """
    channel = grpc.secure_channel(target, credentials) if credentials else grpc.insecure_channel(target)
    with channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def check_health(target: str, timeout_s: float = 1.0, credentials: grpc.ChannelCredentials | None = None) -> bool:
    """True when the gRPC server at ``target`` (host:port) answers SERVING (see :func:`health_status`)."""
    try:
        return health_status(target, timeout_s, credentials) == "SERVING"
    except grpc.RpcError:
        return False


MiB = 1 << 20

CLIENT_API_MAX_MESSAGE_BYTES = 16 * MiB
"""Largest message, in bytes, the gateway's client API accepts or sends (a GenerateRequest with a
long prompt as text or token ids; responses are small deltas)."""

INTERNAL_MAX_MESSAGE_BYTES = 64 * MiB
"""Largest message, in bytes, between the services: a BatchPlan carries new requests in full (256
new 8k-token requests are about 10 MB) and a TokenEventBatch one event per running request."""


def message_size_options(max_bytes: int) -> tuple[tuple[str, int], ...]:
    """gRPC options that cap received and sent messages at ``max_bytes`` (larger: RESOURCE_EXHAUSTED)."""
    return (("grpc.max_receive_message_length", max_bytes), ("grpc.max_send_message_length", max_bytes))


def server_options(max_message_bytes: int) -> tuple[tuple[str, int], ...]:
    """Options for a pagedserve server: a port another process holds is an error, not shared;
    messages up to ``max_message_bytes``."""
    return (("grpc.so_reuseport", 0), *message_size_options(max_message_bytes))


CLIENT_API_SERVER_OPTIONS = server_options(CLIENT_API_MAX_MESSAGE_BYTES)
"""The gateway's server."""
CLIENT_API_CHANNEL_OPTIONS = message_size_options(CLIENT_API_MAX_MESSAGE_BYTES)
"""Channels of clients to the gateway (`pagedserve complete`, `bench serve`)."""
INTERNAL_SERVER_OPTIONS = server_options(INTERNAL_MAX_MESSAGE_BYTES)
"""The scheduler's and the workers' servers."""
RECONNECT_BACKOFF_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)
"""A restarted service is reached again within a second (gRPC's default back-off grows to 120 s).
``grpc.min_reconnect_backoff_ms`` stays unset: gRPC takes it as the time a connection attempt may
take (its default 20 s), and at 100 ms a server busy for a tenth of a second while a channel
connects failed the call UNAVAILABLE ("timed out before receiving SETTINGS frame", "tcp handshaker
shutdown") although its deadline was seconds away."""

INTERNAL_CHANNEL_OPTIONS = message_size_options(INTERNAL_MAX_MESSAGE_BYTES) + RECONNECT_BACKOFF_OPTIONS
"""Channels between services (gateway to scheduler, scheduler to workers, GetStats callers)."""


def host_port(host: str, port: int) -> str:
    """``host:port`` as gRPC targets and URLs write it: an IPv6 address in brackets (``[::1]:50051``)."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def bind(server: grpc.Server | grpc.aio.Server, host: str, port: int,
         credentials: grpc.ServerCredentials | None = None) -> int:
    """Binds a port (with TLS when ``credentials`` is given) and returns the port actually bound
    (useful with port 0).

    Raises:
        OSError: the address cannot be bound.
    """
    address = host_port(host, port)
    try:
        bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    except RuntimeError as exc:  # grpc's way of saying the address is taken
        raise OSError(f"cannot listen on {address}: the port is in use or the address is not local") from exc
    if bound == 0:
        raise OSError(f"cannot listen on {address}")
    return bound
