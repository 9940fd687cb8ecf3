"""The worker skips a plan whose caller stopped waiting before it started (a worker resumed after
a stall, SIGSTOP or swapping, finds the scheduler's timed-out plans queued), and fails its session."""

from __future__ import annotations

import threading

import grpc
import pytest
from opentelemetry import trace

from pagedserve.engine.messages import StepResult
from pagedserve.services.common.pb import engine_pb2 as pb
from pagedserve.services.worker.service import WorkerServicer

pytestmark = pytest.mark.timeout(30)


class Aborted(Exception):
    pass


class Context:
    def __init__(self, active: bool) -> None:
        self.active = active

    def time_remaining(self) -> float:
        return 5.0

    def is_active(self) -> bool:
        return self.active

    def abort(self, code, details):
        raise Aborted(code, details)


class Runner:
    """Records the plans it runs; the first one blocks until released (a long step)."""

    def __init__(self) -> None:
        self.ran: list[tuple[str, int]] = []
        self.release = threading.Event()

    def execute(self, plan):
        if not self.ran:
            self.release.wait(10)
        self.ran.append((plan.session_id, plan.step_id))
        return StepResult(plan.step_id)


def test_a_plan_whose_caller_is_gone_is_skipped_and_fails_its_session():
    runner = Runner()
    servicer = WorkerServicer(runner, trace.get_tracer("test"))
    first = threading.Thread(target=servicer.Execute, args=(pb.BatchPlan(step_id=1, session_id="s1"), Context(True)))
    first.start()
    gone = Context(True)
    outcome: list = []

    def abandoned() -> None:
        try:
            servicer.Execute(pb.BatchPlan(step_id=2, session_id="s1"), gone)
        except Aborted as exc:
            outcome.append(exc.args[0])

    second = threading.Thread(target=abandoned)
    second.start()
    while not servicer._order._next_step == 3:  # the second plan is queued behind the first
        threading.Event().wait(0.01)
    gone.active = False  # its deadline passes while the first step runs
    runner.release.set()
    first.join(10), second.join(10)
    assert outcome == [grpc.StatusCode.CANCELLED] and runner.ran == [("s1", 1)]
    with pytest.raises(Aborted) as refused:  # the session's later plans build on state it never made
        servicer.Execute(pb.BatchPlan(step_id=3, session_id="s1"), Context(True))
    assert refused.value.args[0] == grpc.StatusCode.FAILED_PRECONDITION
    servicer.Execute(pb.BatchPlan(step_id=1, session_id="s2"), Context(True))  # the reset's new session runs
    assert runner.ran == [("s1", 1), ("s2", 1)]
