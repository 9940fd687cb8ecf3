"""Review of issue #13: the worker's lease fence against a scheduler that lost its lease, when the
old owner's plan passes the fence just before the new owner's first plan and starts just after it."""

from __future__ import annotations

import threading

import grpc
import pytest
from opentelemetry import trace

from pagedserve.engine.messages import StepResult
from pagedserve.services.common.pb import engine_pb2 as pb
from pagedserve.services.worker import service
from pagedserve.services.worker.service import WorkerServicer

pytestmark = pytest.mark.timeout(30)


class Aborted(Exception):
    pass


class Context:
    def time_remaining(self):
        return 5.0

    def is_active(self):
        return True

    def abort(self, code, details):
        raise Aborted(code, details)


class Runner:
    def __init__(self) -> None:
        self.ran: list[tuple[str, int]] = []

    def execute(self, plan):
        self.ran.append((plan.session_id, plan.step_id))
        return StepResult(plan.step_id)


def test_a_plan_of_an_older_epoch_never_runs_after_a_newer_epochs_plan(monkeypatch):
    """``Execute`` checks the epoch (``LeaseFence.admit``), then decodes the plan, then waits for
    its turn: the check and the start are not one step. The old owner's first plan of a new session
    (it reset the worker after a timed-out step, not knowing it lost the lease) passes the fence,
    is slow to decode (a big plan); meanwhile the new owner's first plan passes and starts; then the
    old plan starts too (step 1 of another session is always next) and wipes the new owner's session:
    the new owner's next plan waits ORDER_WAIT_S (10 s) and fails. Two schedulers drove the worker."""
    runner = Runner()
    servicer = WorkerServicer(runner, trace.get_tracer("test"))
    new_started = threading.Event()
    decode = service.plan_from_pb

    def slow_decode(message):
        if message.session_id == "old-owner":
            new_started.wait(5)  # the new owner's plan gets in meanwhile
        return decode(message)

    monkeypatch.setattr(service, "plan_from_pb", slow_decode)
    old_result: list = []

    def old_owner() -> None:
        try:
            servicer.Execute(pb.BatchPlan(step_id=1, session_id="old-owner", lease_epoch=1), Context())
            old_result.append("ran")
        except Aborted as exc:
            old_result.append(exc.args[0])

    thread = threading.Thread(target=old_owner)
    thread.start()
    while servicer._fence.newest_epoch != 1:  # the old plan passed the fence
        threading.Event().wait(0.01)
    servicer.Execute(pb.BatchPlan(step_id=1, session_id="new-owner", lease_epoch=2), Context())
    new_started.set()
    thread.join(10)
    assert runner.ran[0] == ("new-owner", 1)
    assert old_result == [grpc.StatusCode.FAILED_PRECONDITION] and runner.ran == [("new-owner", 1)], \
        f"the old owner's plan ran after the new owner's: {runner.ran}"
