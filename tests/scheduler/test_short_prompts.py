"""Short prompts beside long ones (``--short-prompt-share``): a prompt being prefilled leaves a shorter one
the room it needs, up to a share of the step (``RunningSchedule._prefill_share``), and a shorter prompt
passes a long one that waits for an earlier prompt's chunks (``admission_order``). Exact chunk tables
from the scripted runner, which checks every plan; every output the reference's."""

from __future__ import annotations

import random

import pytest

from pagedserve.engine.messages import SequenceId
from tests.scheduler.scripted_runner import reference_output
from tests.scheduler.test_scheduler_features import all_free, collect, make, prompt, req, run


def chunks_per_plan(runners, worker: str = "w") -> list[dict[str, int]]:
    """Per plan sent to ``worker``, the tokens it scheduled per request."""
    return [{r.request_id: r.num_scheduled_tokens for r in p.new_requests + p.cached_requests}
            for p in runners[worker].plans]


@pytest.mark.parametrize("short_len, share, first_plans", [
    # the room the shorter waiting prompt needs is left to it: prefilled at once, it decodes beside the rest
    (3, 0.5, [{"long": 8}, {"long": 5, "short": 3}, {"short": 1, "long": 7}, {"long": 8}, {"long": 2}]),
    # more than half the room: half of it, then what it has left; it finishes before the long prompt
    (6, 0.5, [{"long": 8}, {"long": 4, "short": 4}, {"long": 6, "short": 2}, {"short": 1, "long": 7}, {"long": 5}]),
    # first come, first served: it waits for every chunk of the long prompt
    (3, 0.0, [{"long": 8}, {"long": 8}, {"long": 8}, {"long": 6, "short": 2}, {"long": 1, "short": 1}]),
])
def test_a_short_prompt_is_not_queued_behind_a_long_prompts_chunks(short_len, share, first_plans):
    engine, runners = make({"w": 64}, max_num_batched_tokens=8, max_plans_in_flight=1, short_prompt_share=share)
    outputs: dict = {}
    engine.add_request(req("long", prompt(30, 60), 2))
    collect(engine, outputs)  # long: 8 of 30
    engine.add_request(req("short", prompt(short_len, 5), 2))
    run(engine, outputs)
    assert chunks_per_plan(runners)[:5] == first_plans
    assert outputs[("short", 0)] == reference_output(prompt(short_len, 5), 2)
    assert outputs[("long", 0)] == reference_output(prompt(30, 60), 2)
    assert all_free(engine)


def test_a_long_prompt_keeps_its_share_while_short_prompts_keep_arriving():
    engine, runners = make({"w": 64}, max_num_batched_tokens=8, max_plans_in_flight=1, max_num_seqs=16)
    outputs: dict = {}
    engine.add_request(req("long", prompt(30, 60), 1))
    for i in range(6):
        engine.add_request(req(f"short{i}", prompt(2, 5 + 10 * i), 1))
        collect(engine, outputs)
    # admitted first, it takes the whole room; then all but what each short prompt needs
    assert [plan.get("long", 0) for plan in chunks_per_plan(runners)] == [8, 6, 6, 6, 4, 0]
    run(engine, outputs)
    assert outputs[("long", 0)] == reference_output(prompt(30, 60), 1)
    assert all_free(engine)


def test_a_waiting_prompt_longer_than_what_is_left_waits_for_its_turn():
    engine, runners = make({"w": 64}, max_num_batched_tokens=8, max_plans_in_flight=1)
    outputs: dict = {}
    engine.add_request(req("first", prompt(12, 60), 1))
    collect(engine, outputs)  # first: 8 of 12; 4 left
    engine.add_request(req("second", prompt(6, 5), 1))
    collect(engine, outputs)
    assert chunks_per_plan(runners)[1] == {"first": 4, "second": 4}  # first takes the whole room it needs


def test_no_room_is_held_for_a_waiting_prompt_that_could_not_be_admitted():
    engine, runners = make({"w": 9}, max_num_batched_tokens=8, max_plans_in_flight=1)  # 9 blocks of 4 slots
    outputs: dict = {}
    engine.add_request(req("long", prompt(30, 60), 1))
    collect(engine, outputs)  # long holds 2 blocks and keeps 6 free for the rest of its prompt and its token
    engine.add_request(req("short", prompt(6, 5), 1))  # 2 blocks: 8 of the 7 free ones with long's
    collect(engine, outputs)
    assert chunks_per_plan(runners)[1] == {"long": 8}
    run(engine, outputs)
    assert outputs[("short", 0)] == reference_output(prompt(6, 5), 1)


def test_no_room_is_held_for_a_waiting_prompt_that_max_num_seqs_keeps_out():
    engine, runners = make({"w": 64}, max_num_batched_tokens=8, max_plans_in_flight=1, max_num_seqs=2)
    outputs: dict = {}
    engine.add_request(req("decoding", prompt(2, 5), 12))
    engine.add_request(req("long", prompt(30, 60), 1))
    collect(engine, outputs)
    engine.add_request(req("short", prompt(2, 15), 1))  # waits for a free place
    collect(engine, outputs)
    assert chunks_per_plan(runners)[1] == {"decoding": 1, "long": 7}


def test_a_lower_priority_short_prompt_takes_no_room_from_a_higher_priority_long_one():
    engine, runners = make({"w": 64}, max_num_batched_tokens=8, max_plans_in_flight=1, policy="priority")
    outputs: dict = {}
    engine.add_request(req("long", prompt(30, 60), 1, priority=0))
    collect(engine, outputs)
    engine.add_request(req("low", prompt(3, 5), 1, t=1, priority=5))
    engine.add_request(req("high", prompt(3, 15), 1, t=2, priority=0))
    collect(engine, outputs)
    # the high one is given the room it needs; the low one none, and then waits its turn
    assert chunks_per_plan(runners)[1] == {"long": 5, "high": 3}
    collect(engine, outputs)
    assert chunks_per_plan(runners)[2] == {"long": 8}


@pytest.mark.parametrize("share, first_plans", [
    # the short prompt passes the second long one, which waits for the first's chunks anyway: the first
    # leaves it the 3 tokens it needs; the second is admitted beside the first's last chunk
    (0.5, [{"long1": 8}, {"long1": 5, "short": 3}, {"short": 1, "long1": 7}, {"long1": 8},
           {"long1": 2, "long2": 6}, {"long1": 1, "long2": 7}]),
    # first come, first served: the short prompt waits for both long ones
    (0.0, [{"long1": 8}, {"long1": 8}, {"long1": 8}, {"long1": 6, "long2": 2}, {"long1": 1, "long2": 7},
           {"long2": 8}, {"long2": 8}, {"long2": 5, "short": 3}]),
])
def test_a_short_prompt_passes_a_long_one_waiting_for_an_earlier_prompts_chunks(share, first_plans):
    engine, runners = make({"w": 64}, max_num_batched_tokens=8, max_plans_in_flight=1, short_prompt_share=share)
    outputs: dict = {}
    engine.add_request(req("long1", prompt(30, 60), 2, t=0))
    collect(engine, outputs)
    engine.add_request(req("long2", prompt(30, 5), 2, t=1))
    engine.add_request(req("short", prompt(3, 15), 2, t=2))
    run(engine, outputs)
    assert chunks_per_plan(runners)[:len(first_plans)] == first_plans
    for rid, p in [("long1", prompt(30, 60)), ("long2", prompt(30, 5)), ("short", prompt(3, 15))]:
        assert outputs[(rid, 0)] == reference_output(p, 2)
    assert all_free(engine)


def test_a_passed_prompt_is_admitted_as_soon_as_the_earlier_prompts_chunks_are_done():
    engine, runners = make({"w": 64}, max_num_batched_tokens=8, max_plans_in_flight=1, max_num_seqs=32)
    outputs: dict = {}
    engine.add_request(req("long1", prompt(20, 60), 1, t=0))
    collect(engine, outputs)
    engine.add_request(req("long2", prompt(20, 300), 1, t=1))
    for i in range(8):  # a 4-token prompt every step takes all the room long1 leaves
        engine.add_request(req(f"short{i}", prompt(4, 5 + 10 * i), 1, t=2 + i))
        collect(engine, outputs)
    plans = chunks_per_plan(runners)
    assert [plan.get("long1", 0) for plan in plans] == [8, 4, 4, 4, 0, 0, 0, 0, 0]
    # admitted beside long1's last chunk; from then on first come, first served: no short prompt passes it
    assert [plan.get("long2", 0) for plan in plans] == [0, 0, 0, 4, 4, 4, 4, 4, 0]
    run(engine, outputs)
    assert outputs[("long2", 0)] == reference_output(prompt(20, 300), 1)
    assert all_free(engine)


def test_a_lower_priority_short_prompt_does_not_pass_a_waiting_higher_priority_one():
    engine, runners = make({"w": 64}, max_num_batched_tokens=8, max_plans_in_flight=1, policy="priority")
    outputs: dict = {}
    engine.add_request(req("long1", prompt(30, 60), 1, t=0, priority=0))
    collect(engine, outputs)
    engine.add_request(req("long2", prompt(30, 5), 1, t=1, priority=0))
    engine.add_request(req("low", prompt(3, 15), 1, t=2, priority=5))
    collect(engine, outputs)
    assert chunks_per_plan(runners)[1] == {"long1": 8}


def test_a_fork_at_the_head_is_not_passed_and_gets_its_token_beside_its_parent():
    engine, runners = make({"w": 64}, max_num_batched_tokens=8, max_plans_in_flight=1, max_num_seqs=16)
    outputs: dict = {}
    engine.add_request(req("long", prompt(40, 60), 1, t=0))
    collect(engine, outputs)
    engine.add_request(req("par", prompt(6, 5), 3, t=1, n=2))
    for i in range(6):  # shorter prompts keep arriving behind the fork of sample 1
        collect(engine, outputs)
        engine.add_request(req(f"s{i}", prompt(4, 20 + 7 * i), 1, t=2 + i))
    run(engine, outputs)
    sent = [(k, n.num_computed_tokens, n.num_scheduled_tokens) for k, p in enumerate(runners["w"].plans)
            for n in p.new_requests if n.seq_id == SequenceId("par", 1)]
    assert sent == [(3, 6, 1)]  # forked as soon as its parent's first token came: the prompt's blocks shared
    assert outputs[("par", 1)] == reference_output(prompt(6, 5), 3, 1)
    assert all_free(engine)


def test_under_priority_a_waiting_prompt_is_not_passed_behind_higher_priority_prompts_that_came_later():
    # priority 0: a 120-token prompt every 20 steps and a 2-token one every step; priority 1: the 40-token head
    # and a 4-token prompt every other step behind it. Passing it while later priority-0 prompts are prefilled
    # kept it waiting for good (review 64); it is passed only while earlier ones are.
    rng = random.Random(1)
    engine, runners = make({"w": 8192}, max_num_batched_tokens=8, max_plans_in_flight=1, max_num_seqs=64,
                           policy="priority")
    outputs: dict = {}
    engine.add_request(req("high-long-0", [rng.randrange(3, 30000) for _ in range(120)], 1, priority=0))
    collect(engine, outputs)
    engine.add_request(req("head", [rng.randrange(3, 30000) for _ in range(40)], 1, t=1, priority=1))
    for step in range(200):
        if step % 20 == 19:
            engine.add_request(req(f"high-long-{step}", [rng.randrange(3, 30000) for _ in range(120)], 1, t=2 + step))
        engine.add_request(req(f"high-{step}", [rng.randrange(3, 30000) for _ in range(2)], 1, t=2 + step))
        if step % 2 == 0:
            engine.add_request(req(f"low-{step}", [rng.randrange(3, 30000) for _ in range(4)], 1, t=2 + step,
                                   priority=1))
        collect(engine, outputs)
        if ("head", 0) in outputs:
            break
    assert step < 40, f"the head's first token came only at step {step}"
