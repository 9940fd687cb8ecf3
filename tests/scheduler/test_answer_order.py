"""Answers that overtake each other: with two plans in flight (overlap scheduling), a worker's
answers can reach the scheduler service in the other order (its gRPC handler threads race to send
them). They are applied in the order of their plans (``Engine.arrived``); a sequence whose token an
answered step lacks ends with an error instead of waiting for ever (``LOST_TOKEN_ERROR``)."""

from __future__ import annotations

from concurrent.futures import Future

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.engine.config import SchedulerConfig
from pagedserve.engine.engine import Engine, SentPlan
from pagedserve.engine.limits import LOST_TOKEN_ERROR
from pagedserve.engine.messages import BatchPlan, FinishReason, SequenceId, StepResult
from pagedserve.engine.scheduler import Scheduler
from tests.scheduler.scripted_runner import TOKEN_COUNTS_ONLY, ScriptedRunner, reference_output
from tests.scheduler.test_scheduler_features import all_free, prompt, req


class HeldAnswers:
    """An executor whose workers run each plan when it is sent (in order, as a worker does) and
    whose answers reach the engine only when the test delivers them, in any order."""

    def __init__(self, runners: dict[str, ScriptedRunner]) -> None:
        self.runners = runners
        self._results: dict[int, StepResult] = {}  # by id of the answer's future

    def submit(self, worker_id: str, plan: BatchPlan) -> Future[StepResult]:
        answer: Future[StepResult] = Future()
        self._results[id(answer)] = self.runners[worker_id].execute(plan)
        return answer

    def deliver(self, engine: Engine, sent: SentPlan) -> list:
        """Settles ``sent``'s answer and applies what is due, as the scheduler service's loop does."""
        sent.answer.set_result(self._results.pop(id(sent.answer)))
        return [out for due in engine.arrived(sent) for out in engine.apply(due)]


def make(workers: dict[str, int], **config) -> tuple[Engine, HeldAnswers]:
    cfg = SchedulerConfig(**{"block_size": 4, "max_num_seqs": 8, "max_num_batched_tokens": 64, **TOKEN_COUNTS_ONLY,
                             **config})
    scheduler = Scheduler(cfg)
    for worker_id, num_blocks in workers.items():
        scheduler.add_worker(worker_id, num_blocks)
    executor = HeldAnswers({w: ScriptedRunner(n, cfg.block_size) for w, n in workers.items()})
    return Engine(scheduler, executor), executor


def collect(outputs: dict, produced: list) -> None:
    for out in produced:
        assert out.error is None, out.error
        tokens = outputs.setdefault((out.request_id, out.sample_index), [])
        assert out.first_output_index == len(tokens)
        tokens.extend(out.new_token_ids)


def test_an_answer_that_overtakes_the_one_before_it_waits_for_it():
    """The hang of 3 of 1,000 streams: the decode's answer (step 2) came before the prefill's
    (step 1) and was applied first, as the prefill's token; the prefill's answer was then dropped as
    stale, and the sequence waited for ever for a token of step 2, which had been answered."""
    engine, executor = make({"w": 16})
    engine.add_request(req("a", prompt(4), 3))
    prefill, decode = engine.send_plans().sent
    assert (prefill.plan.step_id, decode.plan.step_id) == (1, 2)
    assert executor.deliver(engine, decode) == []  # held: the prefill's answer comes first
    outputs: dict = {}
    collect(outputs, executor.deliver(engine, prefill))
    assert outputs == {("a", 0): reference_output(prompt(4), 3)[:2]}
    while engine.has_unfinished_requests():
        sent = engine.send_plans().sent
        assert sent, "nothing in flight, and the request waits"
        for s in sent:
            collect(outputs, executor.deliver(engine, s))
    assert outputs == {("a", 0): reference_output(prompt(4), 3)}
    assert all_free(engine)


def test_applying_an_answer_before_the_one_before_it_is_refused():
    engine, executor = make({"w": 16})
    engine.add_request(req("a", prompt(4), 3))
    prefill, decode = engine.send_plans().sent
    for s in (decode, prefill):
        s.answer.set_result(executor._results.pop(id(s.answer)))
    with pytest.raises(ValueError, match="step 2 of worker w applied before step 1"):
        engine.apply(decode)
    assert engine.scheduler.sequence(SequenceId("a")).in_flight_steps == [1, 2]  # nothing applied
    assert [o.new_token_ids for o in engine.apply(prefill) + engine.apply(decode)] == [
        (t,) for t in reference_output(prompt(4), 3)[:2]]


def test_a_sequence_whose_token_an_answered_step_lacks_ends_with_an_error():
    """The safety net: such a sequence would wait for ever (nothing more is scheduled for it)."""
    scheduler = Scheduler(SchedulerConfig(block_size=4, max_num_seqs=8, max_num_batched_tokens=64))
    scheduler.add_worker("w", 16, 0)
    scheduler.add_request(req("a", prompt(4), 1))
    plan = scheduler.schedule(["w"]).plans["w"]
    (output,) = scheduler.update_from_output({"w": StepResult(plan.step_id, ())})  # the worker sampled nothing
    assert (output.request_id, output.finish_reason, output.error) == ("a", FinishReason.ABORT, LOST_TOKEN_ERROR)
    assert not scheduler.has_unfinished_requests()
    assert scheduler.schedule(["w"]).plans["w"].finished_seq_ids == (SequenceId("a"),)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 9), st.integers(1, 5)), min_size=1, max_size=8), st.data())
def test_answers_delivered_in_any_order_give_every_request_its_exact_tokens(specs, data):
    """Two workers, two plans in flight each, shared prefixes; each turn sends what it may, then
    one answer in flight, chosen at random, arrives."""
    engine, executor = make({"w0": 24, "w1": 12}, max_num_seqs=4, max_num_batched_tokens=16)
    for i, (plen, max_tokens) in enumerate(specs):
        engine.add_request(req(f"r{i}", prompt(8, 40) + prompt(plen, 5 * i), max_tokens, t=i))
    outputs: dict = {}
    pending: list[SentPlan] = []
    while engine.has_unfinished_requests() or pending:
        dispatch = engine.send_plans()
        collect(outputs, dispatch.outputs)
        pending += dispatch.sent
        assert pending, "nothing in flight, and requests wait"
        sent = pending.pop(data.draw(st.integers(0, len(pending) - 1)))
        collect(outputs, executor.deliver(engine, sent))
    for i, (plen, max_tokens) in enumerate(specs):
        assert outputs[(f"r{i}", 0)] == reference_output(prompt(8, 40) + prompt(plen, 5 * i), max_tokens)
    assert all_free(engine)
