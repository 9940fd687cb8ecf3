"""The channels between services (``cluster_channel``, ``cluster_aio_channel``) against a real gRPC
server in another process: a server that is busy while a channel connects delays a call, it does not
fail it, and a server that comes up is reached within the reconnect back-off (a second)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.services.common.auth import cluster_aio_channel, cluster_channel
from tests.e2e.ports import free_port

STALL_S = 0.5  # the server stops this long while the channel connects (gRPC once gave it 0.1 s)

SERVER = """
import sys
from concurrent import futures
import grpc
from grpc_health.v1 import health, health_pb2_grpc
server = grpc.server(futures.ThreadPoolExecutor(2))
health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
server.add_insecure_port("127.0.0.1:" + sys.argv[1])
server.start()
print("serving", flush=True)
server.wait_for_termination()
"""


def start_server(port: int) -> subprocess.Popen:
    """A gRPC health server on ``port``, once it serves."""
    process = subprocess.Popen([sys.executable, "-c", SERVER, str(port)], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "serving"
    return process


def stalled_while_connecting(port: int) -> subprocess.Popen:
    """A server stopped (SIGSTOP) now and continued ``STALL_S`` later: its kernel accepts the TCP
    connection, but nothing answers the HTTP/2 handshake until then."""
    process = start_server(port)
    os.kill(process.pid, signal.SIGSTOP)
    threading.Timer(STALL_S, os.kill, (process.pid, signal.SIGCONT)).start()
    return process


def check(stub) -> int:
    return stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status


def test_a_call_waits_for_a_server_busy_while_the_channel_connects():
    port = free_port()
    process = stalled_while_connecting(port)
    try:
        start = time.monotonic()
        with cluster_channel(f"127.0.0.1:{port}", "token") as channel:
            assert check(health_pb2_grpc.HealthStub(channel)) == health_pb2.HealthCheckResponse.SERVING
        assert time.monotonic() - start >= STALL_S - 0.05
    finally:
        process.kill()
        process.wait()


def test_an_asyncio_call_waits_for_a_server_busy_while_the_channel_connects():
    async def call(port: int) -> int:
        async with cluster_aio_channel(f"127.0.0.1:{port}", "token") as channel:
            return (await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)).status

    port = free_port()
    process = stalled_while_connecting(port)
    try:
        assert asyncio.run(call(port)) == health_pb2.HealthCheckResponse.SERVING
    finally:
        process.kill()
        process.wait()


def test_a_server_that_comes_up_is_reached_within_the_reconnect_back_off():
    port = free_port()
    with cluster_channel(f"127.0.0.1:{port}", "token") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for _ in range(4):  # nothing listens: the back-off grows to its 1 s cap
            try:
                check(stub)
            except grpc.RpcError as exc:
                assert exc.code() is grpc.StatusCode.UNAVAILABLE
            time.sleep(0.4)
        process = start_server(port)
        try:
            up = time.monotonic()
            check_with_wait = stub.Check(health_pb2.HealthCheckRequest(), timeout=5, wait_for_ready=True)
            assert check_with_wait.status == health_pb2.HealthCheckResponse.SERVING
            assert time.monotonic() - up < 1.5
        finally:
            process.kill()
            process.wait()
