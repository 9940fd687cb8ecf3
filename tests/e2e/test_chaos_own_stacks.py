"""The chaos faults that need a stack of their own (two workers, or other scheduler flags): what every fault
injects and checks, and the reference streams, are ``test_chaos.py``'s."""

from __future__ import annotations

import time

import grpc
import pytest

from pagedserve.services.common.pb import generate_pb2_grpc
from tests.e2e.faults import assert_no_leak, finish_streams, kill, own_stack, probe, start_streams, start_worker
from tests.e2e.processes import scheduler_stats
from tests.e2e.test_chaos import (MAX_TOKENS, RESULTS, pause, reference, reference_outputs,  # noqa: F401 (fixtures)
                                  summary)
from tests.e2e.test_stack import QUESTIONS, chat_request

STEP_TIMEOUT_ARGS = ("--step-timeout", "4", "--max-num-batched-tokens", "32")
"""The step-timeout fault's scheduler: a step times out after 4 s, and the recompute runs in 32-token steps
(one step prefilling all 8 sequences again took over 4 s on a busy CI machine, three test workers on two
cores, timed out three times, and failed the requests)."""


def test_kill_one_of_two_workers(tmp_path, small_model, reference):
    """kill -9 the busier of two workers: its step fails, it is dropped (and dropped again if
    re-admitted before its heartbeat expires), its sequences are recomputed on the other worker.
    Expected: all 8 streams complete token-identical; the survivor serves new requests. (Placement by
    cached prefix can put all 8 on one worker: the idle one's death would move nothing.)"""
    with own_stack(tmp_path, small_model, num_workers=2) as stack:
        calls = start_streams(stack.gateway, MAX_TOKENS)
        busier = max(scheduler_stats(stack.scheduler).workers, key=lambda w: w.num_running)
        assert busier.num_running > 0, "neither worker runs a stream"
        fault_at = time.monotonic()
        kill(stack, busier.worker_id)
        recovery = probe(stack.gateway, fault_at)
        figures = finish_streams(calls, reference, fault_at, allowed=set())
        assert_no_leak(stack, num_workers=1)
        RESULTS["1 kill one of two workers"] = {**figures, "running_on_killed_worker": busier.num_running,
                                                "new_request_ok_after_s": recovery, "blocks_leaked": 0}


def test_no_worker_for_too_long_fails_the_requests_with_unavailable(tmp_path, small_model, reference):
    """kill -9 the only worker with --no-worker-timeout 3 and start none. Expected: the 8 requests
    go back to waiting and fail with UNAVAILABLE within the timeout + heartbeat expiry (3 s) +
    back-off (<= 2 s) + slack (15 s in all), a request sent then fails with UNAVAILABLE once it has
    waited the timeout itself (not at once: a worker may come within it), and once a worker is started
    new requests succeed."""
    with own_stack(tmp_path, small_model, num_workers=1, scheduler_args=("--no-worker-timeout", "3")) as stack:
        calls = start_streams(stack.gateway, MAX_TOKENS)
        fault_at = time.monotonic()
        kill(stack, "worker-0")
        for call in calls:
            call.thread.join(max(0.0, fault_at + 15 - time.monotonic()))
        figures = finish_streams(calls, reference, fault_at, allowed={grpc.StatusCode.UNAVAILABLE})
        assert figures["completed_identical"] == 0 and figures["last_stream_end_s"] < 15, figures
        sent_at = time.monotonic()
        with pytest.raises(grpc.RpcError) as refused, grpc.insecure_channel(stack.gateway) as channel:
            list(generate_pb2_grpc.GenerationStub(channel).Generate(chat_request(QUESTIONS[3], max_tokens=4), timeout=10))
        refused_after = round(time.monotonic() - sent_at, 2)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and 2.9 < refused_after < 8, (refused.value,
                                                                                                 refused_after)
        start_worker(stack, small_model, "worker-0", tmp_path)
        started_at = time.monotonic()
        recovery = probe(stack.gateway, started_at)
        assert_no_leak(stack, num_workers=1)
        RESULTS["2b kill only worker, none started (--no-worker-timeout 3)"] = {
            **figures, "new_request_refused_after_s": refused_after,
            "new_request_ok_after_worker_start_s": recovery, "blocks_leaked": 0}


def test_worker_step_times_out_without_dying(tmp_path, small_model, reference):
    """SIGSTOP the only worker for 8 s with --step-timeout 4, then SIGCONT. Expected: the step
    times out, the worker is reset (its heartbeat also lapses, so it registers again after
    SIGCONT) and re-admitted after the back-off; it drops its old state (new session id), the
    sequences are recomputed (in 32-token steps: ``STEP_TIMEOUT_ARGS``): all 8 complete
    token-identical."""
    with own_stack(tmp_path, small_model, num_workers=1, scheduler_args=STEP_TIMEOUT_ARGS) as stack:
        calls = start_streams(stack.gateway, MAX_TOKENS)
        fault_at = time.monotonic()
        resumed_at = pause(stack.processes["worker-0"], 8)
        recovery = probe(stack.gateway, fault_at)
        figures = finish_streams(calls, reference, fault_at, allowed=set())
        assert_no_leak(stack, num_workers=1)
        assert "a step failed" in stack.processes["scheduler"].log_text(), "the step did not time out"
        RESULTS["6 worker SIGSTOP 8 s (step timeout 4 s)"] = {
            **figures, "new_request_ok_after_s": recovery,
            "of_which_after_SIGCONT_s": round(recovery - (resumed_at - fault_at), 2), "blocks_leaked": 0}
