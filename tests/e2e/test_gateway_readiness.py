"""The gateway's health means ready: it has reached Redis and a scheduler with a worker, and it has
logged that it listens (issue #24: a test that waited for SERVING then read the log failed)."""

from __future__ import annotations

import os
import signal
import time

import pytest

import grpc

from pagedserve.services.common.grpc_server import check_health
from pagedserve.services.common.pb import generate_pb2 as gen
from pagedserve.services.common.pb import generate_pb2_grpc
from pagedserve.services.gateway.generation_core import ENQUEUE_TIMEOUT_S
from tests.e2e.faults import blocks_free
from tests.e2e.ports import free_port
from tests.e2e.processes import http_health, pagedserve, start_redis, start_stack, stop_all, wait_until
from tests.worker.tiny_models import save_tiny_model, save_tiny_tokenizer

pytestmark = [pytest.mark.e2e]

LISTENING = "OpenAI-compatible HTTP API listening"


def test_health_is_not_serving_while_redis_does_not_answer(tmp_path, default_model):
    """A real redis-server stopped with SIGSTOP accepts connections and answers nothing: the gateway
    has not reached Redis, so its health must not be SERVING (grpc's health servicer starts SERVING)."""
    redis_process, redis_url = start_redis(tmp_path)
    os.kill(redis_process.popen.pid, signal.SIGSTOP)
    port = free_port()
    gateway = pagedserve("gateway", ["gateway", "--redis-url", redis_url, "--model", str(default_model),
                                     "--host", "127.0.0.1", "--port", str(port), "--http-port", "0"],
                         tmp_path, {**os.environ, "PAGEDSERVE_CLUSTER_TOKEN": "t" * 32, "PYTHONUNBUFFERED": "1"})
    try:
        deadline, answered = time.monotonic() + 90, 0
        while answered < 40:  # about 4 s of answers once the port is up
            gateway.check_alive()
            assert time.monotonic() < deadline, gateway.log_text()
            assert not check_health(f"127.0.0.1:{port}", timeout_s=0.5), "SERVING before Redis answered"
            answered += "listening on" in gateway.log_text() or _port_answers(port)
            time.sleep(0.1)
    finally:
        os.kill(redis_process.popen.pid, signal.SIGCONT)
        stop_all({"gateway": gateway, "redis": redis_process})


def _port_answers(port: int) -> bool:
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.model
def test_serving_means_listening_logged_and_http_answering(stack, default_model, tmp_path):
    """From the first SERVING on, the log says both APIs listen and the HTTP API answers."""
    port, http_port = free_port(), free_port()
    gateway = pagedserve("gateway-ready", ["gateway", "--redis-url", stack.redis_url, "--model", str(default_model),
                                           "--host", "127.0.0.1", "--port", str(port), "--http-port", str(http_port)],
                         tmp_path, stack.env)
    try:
        deadline = time.monotonic() + 120
        while not check_health(f"127.0.0.1:{port}", timeout_s=0.5):
            gateway.check_alive()
            assert time.monotonic() < deadline, gateway.log_text()
            time.sleep(0.02)
        assert LISTENING in gateway.log_text()
        assert http_health(f"http://127.0.0.1:{http_port}") == 200
    finally:
        gateway.stop()


def test_a_request_sent_while_redis_hangs_fails_with_unavailable_after_the_enqueue_timeout(tmp_path):
    """Attack (2026-12-07): with Redis stopped (SIGSTOP), a new request waited 1 min 55 s for its 503 (every retry
    of every 10 s socket timeout) though the gateway's health already said NOT_SERVING. Expected: UNAVAILABLE
    after ``ENQUEUE_TIMEOUT_S`` saying Redis did not take it; once Redis answers, nothing runs for it."""
    tiny = save_tiny_tokenizer(save_tiny_model(tmp_path / "tiny", "llama", seed=7))
    stack = start_stack(tmp_path, tiny, num_workers=1, kv_cache_memory="4MiB")
    redis_pid = stack.processes["redis"].popen.pid
    try:
        os.kill(redis_pid, signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as failed, grpc.insecure_channel(stack.gateway) as channel:
            list(generate_pb2_grpc.GenerationStub(channel).Generate(
                gen.GenerateRequest(prompt="t5 t9 t33", sampling_params=gen.SamplingParams(max_tokens=2)), timeout=90))
        waited = time.monotonic() - started
        os.kill(redis_pid, signal.SIGCONT)
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE, failed.value
        assert f"Redis did not take the request within {ENQUEUE_TIMEOUT_S:g} s" in failed.value.details()
        assert ENQUEUE_TIMEOUT_S - 0.5 < waited < ENQUEUE_TIMEOUT_S + 8, waited
        wait_until(lambda: blocks_free(stack), "nothing running or waiting once Redis answers", 30)
    finally:
        os.kill(redis_pid, signal.SIGCONT)
        stop_all(stack.processes)

