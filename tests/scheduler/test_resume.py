"""Scheduler.resume_request (request migration, continuing from the tokens already delivered):
what is queued and with which blocks, the errors, finished samples, aborts; end to end over the
scripted runner (a property test). The tiny real model: tests/scheduler/test_resume_model.py."""

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.engine.config import SchedulerConfig
from pagedserve.engine.messages import EngineRequest, FinishReason, ResumedSample, SequenceId
from pagedserve.engine.sampling_params import EngineSamplingParams, child_sampling
from pagedserve.engine.scheduler import Scheduler
from tests.scheduler.scripted_runner import TOKEN_COUNTS_ONLY, ScriptedRunner, reference_output
from tests.scheduler.test_scheduler import make_engine, run_to_completion

PROMPT = (11, 12, 13, 14, 15, 16)  # 6 tokens: one full block of 4, and 2 slots of the next
NUM_BLOCKS = 16


def make_request(rid: str = "r", n: int = 3, max_tokens: int = 10, **sampling) -> EngineRequest:
    params = EngineSamplingParams(max_tokens=max_tokens, temperature=1.0, seed=7, n=n, eos_token_ids=(2,), **sampling)
    return EngineRequest(rid, PROMPT, params, 0.0)


def make_scheduler(**config) -> Scheduler:
    scheduler = Scheduler(SchedulerConfig(**{"block_size": 4, "max_num_seqs": 8, "max_num_batched_tokens": 64,
                                             **TOKEN_COUNTS_ONLY, **config}))
    scheduler.add_worker("w0", NUM_BLOCKS)
    return scheduler


def free_blocks(scheduler: Scheduler) -> int:
    return scheduler.block_manager("w0").num_free_blocks


def test_each_unfinished_sample_waits_as_its_own_sequence_with_its_tokens():
    scheduler = make_scheduler(enable_prefix_caching=False)
    request = make_request()
    scheduler.resume_request(request, [ResumedSample(0, (21, 22, 23), False), ResumedSample(1, (31, 32), True)])
    assert scheduler.has_request("r") and scheduler.waiting_requests() == ["r"]
    assert scheduler.stats().num_waiting == 2 and scheduler.stats().num_running == 0
    first, third = scheduler.sequence(SequenceId("r", 0)), scheduler.sequence(SequenceId("r", 2))
    assert first.output_token_ids == [21, 22, 23] and third.output_token_ids == []
    assert first.sampling == dataclasses.replace(request.sampling, n=1)
    assert third.sampling == child_sampling(request.sampling, 2)
    with pytest.raises(KeyError):
        scheduler.sequence(SequenceId("r", 1))
    plan = scheduler.schedule(["w0"]).plans["w0"]
    assert [(r.seq_id, r.token_ids, r.num_prompt_tokens, r.block_ids, r.num_computed_tokens, r.num_scheduled_tokens)
            for r in plan.new_requests] == [
        (SequenceId("r", 0), PROMPT + (21, 22, 23), 6, (0, 1, 2), 0, 9),
        (SequenceId("r", 2), PROMPT, 6, (3, 4), 0, 6),
    ]
    assert all(r.sampling.n == 1 for r in plan.new_requests)
    assert scheduler.stats().num_running == 2 and free_blocks(scheduler) == NUM_BLOCKS - 5
    outputs = scheduler.update_from_output({"w0": ScriptedRunner(NUM_BLOCKS, 4).execute(plan)})
    assert [(o.sample_index, o.first_output_index) for o in outputs] == [(0, 3), (2, 0)]


def test_a_resumed_sample_shares_cached_prompt_blocks():
    scheduler = make_scheduler()
    scheduler.resume_request(make_request(), [ResumedSample(0, (21, 22, 23), False), ResumedSample(1, (), True)])
    plan = scheduler.schedule(["w0"]).plans["w0"]
    # sample 0 filled block 0 with the prompt's first 4 tokens; sample 2 takes it from the cache
    assert [(r.block_ids, r.num_computed_tokens, r.num_scheduled_tokens) for r in plan.new_requests] == [
        ((0, 1, 2), 0, 9), ((0, 3), 4, 2)]
    assert free_blocks(scheduler) == NUM_BLOCKS - 4


def test_resumed_requests_wait_ahead_of_later_arrivals():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("first"))
    scheduler.resume_request(make_request(), [ResumedSample(0, (21,), False)])
    scheduler.add_request(make_request("later"))
    assert scheduler.waiting_requests() == ["r", "first", "later"]  # as preempted ones: at the front
    assert scheduler.stats().num_waiting == 5


@pytest.mark.parametrize("resumed", [[], [ResumedSample(0, (), False), ResumedSample(2, (), False)]])
def test_nothing_delivered_is_add_request(resumed):
    fresh, resumed_scheduler = make_scheduler(), make_scheduler()
    fresh.add_request(make_request())
    resumed_scheduler.resume_request(make_request(), resumed)
    plans = [s.schedule(["w0"]).plans["w0"] for s in (fresh, resumed_scheduler)]
    assert plans[0].new_requests == plans[1].new_requests  # one sequence of n=3, forked after the prompt
    assert plans[1].new_requests[0].sampling.n == 3
    assert resumed_scheduler.stats().num_running == 1


@pytest.mark.parametrize("resumed, message", [
    ([ResumedSample(3, (), False)], r"resumed\[0\]\.sample_index: 3 is not in \[0, 3\)"),
    ([ResumedSample(-1, (), False)], r"resumed\[0\]\.sample_index: -1 is not in \[0, 3\)"),
    ([ResumedSample(1, (5,), False), ResumedSample(1, (), True)], r"resumed\[1\]\.sample_index: .* listed twice"),
    ([ResumedSample(0, (5,) * 11, True)], r"resumed\[0\]\.output_token_ids: 11 tokens, more than max_tokens \(10\)"),
    ([ResumedSample(0, (5,) * 10, False)], r"resumed\[0\]\.finished: output token 9 \(5\) ends the sample"),
    ([ResumedSample(2, (5, 2, 6), False)], r"resumed\[0\]\.finished: output token 1 \(2\) ends the sample"),
])
def test_invalid_resumed_samples_raise_and_change_nothing(resumed, message):
    scheduler = make_scheduler()
    with pytest.raises(ValueError, match=message):
        scheduler.resume_request(make_request(), resumed)
    assert not scheduler.has_request("r") and scheduler.stats().num_waiting == 0
    assert scheduler.schedule(["w0"]).plans == {}


def test_eos_within_min_tokens_does_not_end_a_sample():
    scheduler = make_scheduler()
    scheduler.resume_request(make_request(min_tokens=3), [ResumedSample(0, (5, 2, 6), False)])
    assert scheduler.sequence(SequenceId("r", 0)).output_token_ids == [5, 2, 6]


def test_a_request_in_flight_cannot_be_resumed():
    scheduler = make_scheduler()
    scheduler.add_request(make_request())
    with pytest.raises(ValueError, match=r"request_id: request 'r' is already in flight"):
        scheduler.resume_request(make_request(), [ResumedSample(0, (5,), False)])
    assert scheduler.stats().num_waiting == 1 and scheduler.sequence(SequenceId("r", 0)).output_token_ids == []


def test_all_finished_adds_nothing():
    scheduler = make_scheduler()
    scheduler.resume_request(make_request(), [ResumedSample(i, (5,) * i, True) for i in range(3)])
    assert not scheduler.has_request("r") and not scheduler.has_unfinished_requests()
    assert scheduler.schedule(["w0"]).plans == {}


def test_has_request_and_aborts_know_every_resumed_sample():
    scheduler = make_scheduler()
    scheduler.resume_request(make_request(), [ResumedSample(0, (21,), True), ResumedSample(1, (31, 32), False)])
    assert scheduler.has_request("r")  # sample 0 is finished: the fork group knows the others
    plan = scheduler.schedule(["w0"]).plans["w0"]
    scheduler.update_from_output({"w0": ScriptedRunner(NUM_BLOCKS, 4).execute(plan)})
    assert free_blocks(scheduler) == NUM_BLOCKS - 3  # sample 1: 8 slots, sample 2: 6 (sharing block 0)
    assert [(o.sample_index, o.finish_reason) for o in scheduler.abort_sample(SequenceId("r", 2))] == [(2, FinishReason.ABORT)]
    assert scheduler.has_request("r")
    outputs = scheduler.abort_request("r")
    assert [(o.sample_index, o.first_output_index, o.finish_reason) for o in outputs] == [(1, 3, FinishReason.ABORT)]
    assert not scheduler.has_request("r") and free_blocks(scheduler) == NUM_BLOCKS


def test_abort_of_a_resumed_request_frees_every_block():
    scheduler = make_scheduler()
    scheduler.resume_request(make_request(), [ResumedSample(0, (21, 22), False), ResumedSample(2, (41,) * 5, False)])
    plan = scheduler.schedule(["w0"]).plans["w0"]
    scheduler.update_from_output({"w0": ScriptedRunner(NUM_BLOCKS, 4).execute(plan)})
    assert scheduler.stats().num_running == 3 and free_blocks(scheduler) < NUM_BLOCKS
    outputs = scheduler.abort_request("r")
    assert sorted(o.sample_index for o in outputs) == [0, 1, 2]
    assert not scheduler.has_request("r") and free_blocks(scheduler) == NUM_BLOCKS
    assert scheduler.stats().num_running == 0 and scheduler.stats().num_waiting == 0


@settings(max_examples=40, deadline=None)
@given(data=st.data(), n=st.integers(1, 3), prompt_len=st.integers(1, 9), max_tokens=st.integers(1, 12))
def test_resumed_samples_continue_with_the_tokens_of_an_undisturbed_run(data, n, prompt_len, max_tokens):
    """The scripted runner's token is a function of the sequence so far (a forked sample's first
    token also of its index, so samples i > 0 resume after their first token here)."""
    engine, _ = make_engine({"w0": 24}, max_num_batched_tokens=16)
    prompt = tuple(range(5, 5 + prompt_len))
    request = EngineRequest("r", prompt, EngineSamplingParams(max_tokens=max_tokens, n=n), 0.0)
    expected = [reference_output(list(prompt), max_tokens, i) for i in range(n)]
    ks = [data.draw(st.integers(0 if i == 0 else 1, max_tokens), label=f"k{i}") for i in range(n)]
    finished = [k == max_tokens or data.draw(st.booleans(), label=f"finished{i}") for i, k in enumerate(ks)]
    resumed = [ResumedSample(i, tuple(expected[i][:k]), done) for i, (k, done) in enumerate(zip(ks, finished))]
    engine.scheduler.resume_request(request, resumed)
    engine.add_request(EngineRequest("other", prompt[::-1], EngineSamplingParams(max_tokens=5), 1.0))
    got: dict[int, list[int]] = {i: list(expected[i][:k]) for i, k in enumerate(ks)}
    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.request_id == "r":
                assert not finished[out.sample_index] and out.first_output_index == len(got[out.sample_index])
                got[out.sample_index] += out.new_token_ids
    assert got == {i: expected[i] if not finished[i] else expected[i][:ks[i]] for i in range(n)}
    assert all(w.num_free_blocks == w.num_blocks for w in engine.scheduler.stats().workers)


def test_a_greedy_request_resumed_mid_output_matches_the_reference():
    engine, _ = make_engine({"w0": 8})
    prompt = list(range(20, 27))
    expected = reference_output(prompt, 9)
    engine.scheduler.resume_request(EngineRequest("g", tuple(prompt), EngineSamplingParams(max_tokens=9), 0.0),
                                    [ResumedSample(0, tuple(expected[:5]), False)])
    assert run_to_completion(engine, {"g": expected[:5]})["g"] == expected
