"""Overlap scheduling (``max_plans_in_flight=2``): the next plan is sent before the worker answers
the current one; a decode is scheduled before its input token is known, a token that ends a
sequence costs one discarded step, and nothing leaks (scripted runner: exact KV contents)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.engine.messages import SequenceId
from tests.scheduler.scripted_runner import reference_output
from tests.scheduler.test_scheduler_features import all_free, make, prompt, req, run


def test_the_next_decode_is_sent_before_its_input_token_is_known():
    engine, runners = make({"w": 16})
    engine.add_request(req("a", prompt(4), 5))
    outputs = engine.step()  # sends the prefill and, at once, the first decode; answers the prefill
    assert [o.new_token_ids for o in outputs] == [(reference_output(prompt(4), 5)[0],)]
    seq = engine.scheduler.sequence(SequenceId("a"))
    assert (seq.num_output_tokens, seq.num_tokens_in_flight, seq.num_computed_tokens) == (1, 1, 5)
    got = run(engine, {("a", 0): list(outputs[0].new_token_ids)})
    assert got[("a", 0)] == reference_output(prompt(4), 5)
    plans = runners["w"].plans
    decodes = [(c.num_computed_tokens, c.num_scheduled_tokens) for p in plans[1:] for c in p.cached_requests]
    assert decodes == [(4, 1), (5, 1), (6, 1), (7, 1)]  # max_tokens known ahead: no step wasted
    assert all_free(engine)


def test_a_stop_token_costs_one_discarded_step_and_leaks_nothing():
    expected = reference_output(prompt(6), 10)
    engine, runners = make({"w": 16})
    engine.add_request(req("a", prompt(6), 10, stop_token_ids=(expected[2],)))
    engine.add_request(req("b", prompt(5, 30), 6))
    got = run(engine)
    assert got[("a", 0)] == expected[:3]
    assert got[("b", 0)] == reference_output(prompt(5, 30), 6)
    a_steps = [c.num_computed_tokens for p in runners["w"].plans for c in p.cached_requests if c.request_id == "a"]
    assert a_steps == [6, 7, 8]  # the step at 8 ran ahead of the stop token at 8 and was discarded
    dropped = [p for p in runners["w"].plans if SequenceId("a") in p.finished_seq_ids]
    assert len(dropped) == 1  # and the worker was told to drop it once
    assert all_free(engine)


def test_one_plan_in_flight_waits_for_every_answer():
    engine, runners = make({"w": 16}, max_plans_in_flight=1)
    engine.add_request(req("a", prompt(4), 3))
    engine.step()
    seq = engine.scheduler.sequence(SequenceId("a"))
    assert (seq.num_output_tokens, seq.num_tokens_in_flight, seq.num_computed_tokens) == (1, 0, 4)
    assert run(engine, {("a", 0): [reference_output(prompt(4), 3)[0]]})[("a", 0)] == reference_output(prompt(4), 3)


def test_a_sequence_preempted_with_a_token_in_flight_gets_it_and_resumes_exactly():
    engine, runners = make({"w": 6}, max_num_seqs=4)  # 24 slots for 3 sequences of up to 16
    reqs = [req(f"r{i}", prompt(5, 7 * i), 11, t=i) for i in range(3)]
    for r in reqs:
        engine.add_request(r)
    in_flight_when_preempted = []
    running = engine.scheduler._running
    requeue = running.requeue
    running.requeue = lambda seq: (in_flight_when_preempted.append(seq.num_tokens_in_flight), requeue(seq))
    got = run(engine)
    assert in_flight_when_preempted and max(in_flight_when_preempted) == 1
    for r in reqs:
        assert got[(r.request_id, 0)] == reference_output(list(r.prompt_token_ids), 11)
    resumed = [n for p in runners["w"].plans for n in p.new_requests if len(n.token_ids) > n.num_prompt_tokens]
    assert resumed  # sent in full again, with every token it had (the one in flight included)
    assert all_free(engine)


def test_a_lone_sequence_that_fills_the_cache_waits_for_its_last_token():
    engine, _ = make({"w": 4})  # 16 slots
    engine.add_request(req("long", prompt(4), 100))
    got = run(engine)
    assert got[("long", 0)] == reference_output(prompt(4), 13)  # slots 4..15 computed: 13 tokens
    assert all_free(engine)


def test_forked_samples_wait_for_the_first_tokens():
    engine, _ = make({"w": 32})
    engine.add_request(req("n3", prompt(6), 4, n=3))
    got = run(engine)
    assert got == {("n3", i): reference_output(prompt(6), 4, i) for i in range(3)}
    assert all_free(engine)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 14), st.integers(1, 9), st.integers(0, 8), st.booleans()), min_size=1, max_size=8),
    st.integers(8, 16),
    st.sampled_from([1, 2]),
)
def test_stop_tokens_with_shared_prefixes_and_preemption_stay_exact(specs, num_blocks, plans_in_flight):
    """A stop token at any position, with overlap on or off: output up to the stop, nothing leaked."""
    engine, _ = make({"w0": num_blocks, "w1": num_blocks // 2 + 2}, max_num_seqs=3, max_num_batched_tokens=12,
                     max_plans_in_flight=plans_in_flight)
    shared = prompt(8, 40)
    expected = {}
    for i, (plen, max_tokens, stop_at, share) in enumerate(specs):
        p = (shared + prompt(plen, 5 * i))[: 8 + plen] if share else prompt(plen, 5 * i)
        full = reference_output(p, max_tokens)
        stop = (full[stop_at],) if stop_at < max_tokens else ()
        expected[(f"r{i}", 0)] = full[: full.index(stop[0]) + 1] if stop else full
        engine.add_request(req(f"r{i}", p, max_tokens, t=i, stop_token_ids=stop))
    got = run(engine)
    for key, want in expected.items():
        assert got[key] == want[: len(got[key])] and got[key]  # shorter only when it filled a whole worker
    assert sum(got[k] == want for k, want in expected.items()) >= len(expected) // 2
    assert all_free(engine)


def test_an_answer_to_a_step_sent_for_an_aborted_incarnation_never_reaches_the_request_taken_again():
    """Issue #20's attack run (entries moved between schedulers every 0.2 s): a request aborted
    while a step sampling its next token was in flight, then taken again under the same id (a
    migration back to this scheduler), got the old step's token as its first output: 6 of 16
    clients received a token of output index 2 first, with status OK. A sampled token is applied
    only to the incarnation whose step it answers."""
    from pagedserve.engine.messages import SampledToken, StepResult
    from pagedserve.engine.scheduler import Scheduler
    from pagedserve.engine.config import SchedulerConfig

    scheduler = Scheduler(SchedulerConfig(block_size=4, max_num_seqs=8, max_num_batched_tokens=64))
    scheduler.add_worker("w", 16, 0)
    scheduler.add_request(req("r", prompt(4), 5))
    first = scheduler.schedule(["w"]).plans["w"]  # the prefill: samples output 0
    scheduler.abort_request("r")  # fenced by its gateway while that step runs ...
    scheduler.add_request(req("r", prompt(4), 5))  # ... and taken again
    second = scheduler.schedule(["w"]).plans["w"]
    assert [n.seq_id for n in second.new_requests] == [SequenceId("r")] and SequenceId("r") in second.finished_seq_ids
    stale = StepResult(first.step_id, (SampledToken(SequenceId("r"), 777, 0.0),))
    assert scheduler.update_from_output({"w": stale}) == []
    (output,) = scheduler.update_from_output({"w": StepResult(second.step_id, (SampledToken(SequenceId("r"), 55, 0.0),))})
    assert (output.first_output_index, output.new_token_ids) == (0, (55,))
