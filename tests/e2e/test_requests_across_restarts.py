"""Requests across a service's crash or Redis's restart (real processes, Redis and gRPC), on one stack with
one worker: requests whose clients gave up do not run after a scheduler restart, requests fail fast while
no worker is left and run again under a restarted one, and a request whose stream entry Redis lost before
any scheduler read it is queued again. Each test reproduces a defect found on the way (issue #9, #13, #20)
and failed on the code before its fix; they run in this order on the small random-weight model. Moved out
of test_request_lifecycle.py (2026-12-06)."""

from __future__ import annotations

import signal
import time

import grpc
import pytest
import redis

from pagedserve.services.common import redis_keys
from pagedserve.services.common.pb import generate_pb2_grpc
from tests.e2e.processes import healthy, pagedserve, scheduler_stats, start_stack, wait_until
from tests.e2e.test_stack import QUESTIONS, assert_all_blocks_free, chat_request, stream

pytestmark = [pytest.mark.e2e, pytest.mark.model]


@pytest.fixture(scope="module")
def one_worker_stack(tmp_path_factory, small_model):
    s = start_stack(tmp_path_factory.mktemp("one-worker"), small_model, num_workers=1, worker_threads=2,
                    scheduler_args=("--no-worker-timeout", "3"))
    yield s
    s.stop()


def test_orphans_are_not_run_after_a_scheduler_restart(one_worker_stack, tmp_path):
    """Defect 12: requests whose clients had already given up ran again after a scheduler restart."""
    stack = one_worker_stack
    calls = []
    with grpc.insecure_channel(stack.gateway) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        for i in range(4):
            calls.append(stub.Generate(chat_request(QUESTIONS[i], max_tokens=300, ignore_eos=True), timeout=6))
        next(calls[0])  # running
        old = stack.processes["scheduler"]
        old.popen.kill()  # a crash: the requests stay pending in Redis
        old.popen.wait()
        for call in calls:  # their clients give up
            with pytest.raises(grpc.RpcError) as info:
                list(call)
            assert info.value.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE)
    time.sleep(1.0)
    stack.processes["scheduler"] = pagedserve("scheduler-restarted", [
        "scheduler", "--redis-url", stack.redis_url, "--host", "127.0.0.1", "--port", stack.scheduler.rsplit(":", 1)[1],
        "--consumer-name", "scheduler-0", "--no-worker-timeout", "3"], tmp_path, stack.env)
    wait_until(lambda: healthy(stack.scheduler), "restarted scheduler", 60, [stack.processes["scheduler"]])
    wait_until(lambda: len(scheduler_stats(stack.scheduler).workers) == 1, "worker admitted", 30)
    time.sleep(3.0)
    stats = scheduler_stats(stack.scheduler)
    assert (stats.num_steps, stats.num_running, stats.num_waiting) == (0, 0, 0), stats
    assert redis.Redis.from_url(stack.redis_url).xlen(redis_keys.REQUEST_STREAM) == 0


def test_without_workers_requests_fail_fast_and_health_says_so(one_worker_stack, small_model, tmp_path):
    """Defects 5 and 6: with every worker gone requests waited forever and health said SERVING;
    a worker restarted under the same id was ignored."""
    stack = one_worker_stack
    worker = stack.processes["worker-0"]
    worker.popen.kill()
    worker.popen.wait()
    wait_until(lambda: not healthy(stack.gateway), "gateway NOT_SERVING", 20)
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        stream(stack.gateway, chat_request(QUESTIONS[1], max_tokens=4))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "worker" in info.value.details()
    assert time.monotonic() - started < 10
    stack.processes["worker-0"] = pagedserve("worker-0-again", [
        "worker", "--redis-url", stack.redis_url, "--model", str(small_model), "--host", "127.0.0.1",
        "--port", "0", "--kv-cache-memory", "64MiB", "--worker-id", "worker-0"], tmp_path, stack.env)
    wait_until(lambda: healthy(stack.gateway), "gateway SERVING again", 120, [stack.processes["worker-0"]])
    assert stream(stack.gateway, chat_request(QUESTIONS[1], max_tokens=4))[-1].finish_reason
    assert_all_blocks_free(stack)


def test_a_request_lost_with_redis_before_any_scheduler_took_it_is_queued_again(one_worker_stack):
    """Review finding: a request whose stream entry vanished (Redis restarted empty) before a
    scheduler read it waited silently until the client's deadline (then, from issue #13 on, it
    failed with UNAVAILABLE). Nothing ran for it, so the gateway queues it again (issue #20) and it
    completes once a scheduler reads it."""
    stack = one_worker_stack
    scheduler = stack.processes["scheduler"].popen
    client = redis.Redis.from_url(stack.redis_url)
    scheduler.send_signal(signal.SIGSTOP)
    try:
        with grpc.insecure_channel(stack.gateway) as channel:
            call = generate_pb2_grpc.GenerationStub(channel).Generate(chat_request(QUESTIONS[3], max_tokens=4),
                                                                     timeout=60)
            time.sleep(1.0)
            client.flushall()
            wait_until(lambda: client.xlen(redis_keys.REQUEST_STREAM) == 1, "the request queued again", 15)
            scheduler.send_signal(signal.SIGCONT)
            responses = list(call)
    finally:
        scheduler.send_signal(signal.SIGCONT)
    assert responses[-1].finish_reason and sum(len(r.token_ids) for r in responses) == 4
    wait_until(lambda: healthy(stack.gateway), "gateway SERVING", 60)
    assert stream(stack.gateway, chat_request(QUESTIONS[3], max_tokens=4))[-1].finish_reason
