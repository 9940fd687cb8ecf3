"""The worker runs a session's plans in step order, whatever order their calls arrive in
(overlap scheduling sends the next plan before the current one is answered)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import pytest

from pagedserve.engine.messages import BatchPlan
from pagedserve.services.worker.service import PlanOrder, PlanOutOfOrder


def _started(order: PlanOrder, plan: BatchPlan, log: list, timeout_s: float = 5.0) -> Future:
    def start() -> Future:
        log.append((plan.session_id, plan.step_id))
        done: Future = Future()
        done.set_result(None)
        return done
    return order.start_in_turn(plan, timeout_s, start)


def test_a_plan_that_arrives_early_waits_for_the_one_before():
    order, log = PlanOrder(), []
    early = threading.Thread(target=_started, args=(order, BatchPlan(step_id=2, session_id="s"), log))
    early.start()
    time.sleep(0.2)
    assert log == []  # plan 2 is held back
    _started(order, BatchPlan(step_id=1, session_id="s"), log)
    early.join(5)
    assert log == [("s", 1), ("s", 2)]


def test_a_new_session_starts_at_step_one_and_older_sessions_are_refused():
    order, log = PlanOrder(), []
    for step in (1, 2, 3):
        _started(order, BatchPlan(step_id=step, session_id="old"), log)
    _started(order, BatchPlan(step_id=1, session_id="new"), log)
    with pytest.raises(PlanOutOfOrder, match="expects plan 2 of session new"):
        _started(order, BatchPlan(step_id=4, session_id="old"), log, timeout_s=0.2)
    with pytest.raises(PlanOutOfOrder):
        _started(order, BatchPlan(step_id=3, session_id="new"), log, timeout_s=0.2)  # 2 never came
    assert log == [("old", 1), ("old", 2), ("old", 3), ("new", 1)]


def test_plans_after_a_failed_plan_of_their_session_are_refused():
    order = PlanOrder()
    order.failed(BatchPlan(step_id=1, session_id="s"))
    with pytest.raises(PlanOutOfOrder, match="earlier plan"):
        order.check(BatchPlan(step_id=2, session_id="s"))
    order.check(BatchPlan(step_id=1, session_id="t"))  # a new session is not affected
