"""A gateway process of its own on the session stack: it closes HTTP connections whose request
headers never complete, and on SIGTERM it drains (issue #20)."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.services.common.pb import generate_pb2_grpc
from pagedserve.services.gateway.config import SHUTDOWN_CLOSE_S
from tests.e2e.processes import gateway_in_flight, http_health, scheduler_stats, start_gateway, wait_until
from tests.e2e.test_stack import QUESTIONS, assert_all_blocks_free, chat_request

pytestmark = [pytest.mark.e2e, pytest.mark.model]

HEADER_TIMEOUT_S = 1.0
SHUTDOWN_GRACE_S = 60.0  # far more than the streams below take: they all finish within it
STREAM_TOKENS = 48  # long enough to be caught in flight


@pytest.fixture(scope="module")
def gateway(stack, default_model, tmp_path_factory):
    """(process, gRPC address, HTTP base URL, served model name) of a second gateway with a short header timeout."""
    process, address, http = start_gateway(
        "own-gateway", stack, default_model, tmp_path_factory.mktemp("own-gateway"),
        ("--http-header-timeout-s", str(HEADER_TIMEOUT_S), "--shutdown-grace-s", str(SHUTDOWN_GRACE_S)))
    try:
        yield process, address, http, default_model.name
    finally:
        process.stop()


def _closed_by_server_within(sock: socket.socket, timeout_s: float) -> float | None:
    """Seconds until the server closed ``sock`` (EOF or reset), None if it stayed open ``timeout_s``."""
    started = time.monotonic()
    sock.settimeout(timeout_s)
    try:
        while sock.recv(4096):
            pass
    except socket.timeout:
        return None
    except ConnectionResetError:
        pass
    return time.monotonic() - started


def test_http_connections_with_incomplete_headers_are_closed_after_the_bound(gateway):
    _, _, http, _ = gateway
    port = int(http.rsplit(":", 1)[1])
    half_line = socket.create_connection(("127.0.0.1", port))
    half_line.sendall(b"GET /hea")
    half_headers = socket.create_connection(("127.0.0.1", port))
    half_headers.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
    silent = socket.create_connection(("127.0.0.1", port))
    kept_alive = socket.create_connection(("127.0.0.1", port))  # a complete request first, then half a second one
    kept_alive.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert kept_alive.recv(4096).startswith(b"HTTP/1.1 200")
    kept_alive.sendall(b"GET /health HTTP/1.1\r\n")
    with half_line, half_headers, silent, kept_alive:
        waited = [_closed_by_server_within(s, 15 * HEADER_TIMEOUT_S) for s in (half_line, half_headers, silent, kept_alive)]
    assert all(w is not None for w in waited), waited
    assert http_health(http) == 200  # complete requests are served as before


def _stream(address: str, question: str, max_tokens: int) -> list[int] | str:
    with grpc.insecure_channel(address) as channel:
        try:
            request = chat_request(question, max_tokens=max_tokens, ignore_eos=True)
            return [t for r in generate_pb2_grpc.GenerationStub(channel).Generate(request, timeout=300)
                    for t in r.token_ids]
        except grpc.RpcError as exc:
            return f"{exc.code().name}: {exc.details()}"


async def _http_stream(http: str, model: str, question: str, max_tokens: int) -> str:
    """The finish reason of a streamed chat completion, or its failure (an error event, no ``[DONE]``)."""
    body = {"model": model, "messages": [{"role": "user", "content": question}],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    finish_reason, done = "error: no finish reason", False
    async with httpx.AsyncClient(base_url=http, timeout=300) as client, \
            client.stream("POST", "/v1/chat/completions", json=body) as response:
        async for line in response.aiter_lines():
            done = done or line == "data: [DONE]"
            if line.startswith("data: {"):
                chunk = json.loads(line[len("data: "):])
                if "error" in chunk:
                    return f"error {chunk['error']}"
                finish_reason = chunk["choices"][0]["finish_reason"] or finish_reason
    return finish_reason if done else "error: no [DONE]"


def _grpc_health(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status


def test_sigterm_drains_streams_in_flight_refuses_new_ones_and_exits(stack, gateway):
    """Last in this module: the gateway exits."""
    process, address, http, model = gateway
    questions = QUESTIONS[:4]

    async def streams() -> list:
        return await asyncio.gather(*(asyncio.to_thread(_stream, address, q, STREAM_TOKENS) for q in questions[:2]),
                                    *(_http_stream(http, model, q, STREAM_TOKENS) for q in questions[2:]))

    async def scenario():
        in_flight = asyncio.ensure_future(streams())
        await asyncio.to_thread(wait_until, lambda: gateway_in_flight(http) >= 4, "4 streams in flight", 60)
        process.popen.terminate()
        signalled.append(time.monotonic())
        await asyncio.to_thread(wait_until, lambda: _grpc_health(address) == health_pb2.HealthCheckResponse.NOT_SERVING,
                                "NOT_SERVING", 10)
        refused_grpc = await asyncio.to_thread(_stream, address, questions[0], 4)
        async with httpx.AsyncClient(base_url=http, timeout=30) as client:
            health = (await client.get("/health")).status_code
            refused = await client.post("/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 2})
        return await in_flight, refused_grpc, health, refused

    signalled = []
    results, refused_grpc, health, refused = asyncio.run(scenario())
    # every stream in flight finished, with its full output
    assert [len(r) if isinstance(r, list) else r for r in results[:2]] == [STREAM_TOKENS] * 2, results
    assert results[2:] == ["length"] * 2, results
    assert refused_grpc.startswith("UNAVAILABLE: the gateway is shutting down"), refused_grpc
    assert health == 503
    assert refused.status_code == 503 and refused.headers["retry-after"] and "shutting down" in refused.text
    assert process.popen.wait(timeout=SHUTDOWN_GRACE_S) == 0
    print(f"\ndrained 4 streams and exited {time.monotonic() - signalled[0]:.1f} s after SIGTERM")
    assert "draining: 4 request(s) in flight" in process.log_text()
    assert_all_blocks_free(stack)


def test_streams_left_when_the_shutdown_grace_passes_end_with_unavailable(stack, default_model, tmp_path):
    grace_s = 1.0
    process, address, http = start_gateway("short-grace-gateway", stack, default_model, tmp_path,
                                           ("--shutdown-grace-s", str(grace_s)))
    try:
        with ThreadPoolExecutor(1) as pool:
            endless = pool.submit(_stream, address, QUESTIONS[0], 1000)  # far longer than the grace
            wait_until(lambda: gateway_in_flight(http) == 1, "the stream in flight", 60)
            signalled = time.monotonic()
            process.popen.terminate()
            result = endless.result(timeout=60)
        assert process.popen.wait(timeout=60) == 0
        exited_s = time.monotonic() - signalled
    finally:
        process.stop()
    assert result.startswith("UNAVAILABLE: the gateway shut down before the request finished"), result
    print(f"\nexited {exited_s:.1f} s after SIGTERM (grace {grace_s:g} s)")
    assert exited_s <= grace_s + SHUTDOWN_CLOSE_S + 2.0  # + 2 s: Python's exit and a busy machine
    assert "ending the 1 request(s) still in flight" in process.log_text()
    # the gateway aborted the request before it exited: the scheduler stops it within a step or two, not
    # after its gateway grace (10 s), when it would drop the requests of a gateway whose stream stayed closed
    wait_until(lambda: scheduler_stats(stack.scheduler).num_running == 0, "the request aborted", 8)
    assert_all_blocks_free(stack)
