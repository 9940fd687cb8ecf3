"""Nothing is lost when the scheduler dies: a request in flight completes through a restarted
scheduler (re-read from the Redis stream, recomputed, repeats dropped by the gateway), and the
restarted scheduler serves new requests."""

from __future__ import annotations

import signal
import threading

import grpc
import pytest

from services.common.pb import generate_pb2_grpc
from tests.e2e.processes import healthy, pagedserve, scheduler_stats, start_stack, wait_until
from tests.e2e.test_stack import QUESTIONS, assert_all_blocks_free, chat_request, stream

pytestmark = [pytest.mark.e2e, pytest.mark.model]


@pytest.fixture(scope="module")
def own_stack(tmp_path_factory, default_model):
    s = start_stack(tmp_path_factory.mktemp("restart"), default_model, num_workers=1, worker_threads=2)
    yield s
    s.stop()


def restart_scheduler(stack, log_dir) -> None:
    old = stack.processes["scheduler"]
    old.popen.send_signal(signal.SIGKILL)  # a crash: no goodbye to anyone
    old.popen.wait()
    port = stack.scheduler.rsplit(":", 1)[1]
    stack.processes["scheduler"] = pagedserve("scheduler-restarted", [
        "scheduler", "--redis-url", stack.redis_url, "--host", "127.0.0.1", "--port", port,
        "--consumer-name", "scheduler-0"], log_dir, stack.env)
    wait_until(lambda: healthy(stack.scheduler), "restarted scheduler", 60, [stack.processes["scheduler"]])


def test_a_request_in_flight_survives_a_scheduler_crash(own_stack, tmp_path):
    request = chat_request(QUESTIONS[2], max_tokens=40, ignore_eos=True)
    expected = stream(own_stack.gateway, request)
    received: list = []
    failure: list = []
    started = threading.Event()

    def client() -> None:
        try:
            with grpc.insecure_channel(own_stack.gateway) as channel:
                for response in generate_pb2_grpc.GenerationStub(channel).Generate(request, timeout=300):
                    received.append(response)
                    if len(received) == 3:
                        started.set()
        except grpc.RpcError as exc:
            failure.append(exc)
        started.set()

    thread = threading.Thread(target=client)
    thread.start()
    assert started.wait(120)
    restart_scheduler(own_stack, tmp_path)
    thread.join(300)
    assert not failure, failure
    assert "".join(r.text for r in received) == "".join(r.text for r in expected)
    assert [t for r in received for t in r.token_ids] == [t for r in expected for t in r.token_ids]
    assert received[-1].usage.completion_tokens == 40
    # and the restarted scheduler takes new requests
    again = stream(own_stack.gateway, chat_request(QUESTIONS[3], max_tokens=8))
    assert again[-1].finish_reason
    wait_until(lambda: len(scheduler_stats(own_stack.scheduler).workers) == 1, "worker known", 10)
    assert_all_blocks_free(own_stack)
