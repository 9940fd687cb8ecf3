"""Building blocks every gRPC service uses: health checking and address helpers."""

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


def check_health(target: str, timeout_s: float = 1.0) -> bool:
    """True when the gRPC server at ``target`` (host:port) answers SERVING."""
    try:
        with grpc.insecure_channel(target) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        return reply.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


SERVER_OPTIONS = (("grpc.so_reuseport", 0),)
"""Options for every pagedserve server: a port another process holds is an error, not shared."""


def bind(server: grpc.Server | grpc.aio.Server, host: str, port: int) -> int:
    """Binds an insecure port and returns the port actually bound (useful with port 0).

    Raises:
        OSError: the address cannot be bound.
    """
    try:
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError as exc:  # grpc's way of saying the address is taken
        raise OSError(f"cannot listen on {host}:{port}: the port is in use or the address is not local") from exc
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port}")
    return bound
