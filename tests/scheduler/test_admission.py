"""Admission headroom (engine/admission.py): waiting requests are admitted with room for the running
ones' growth, so fewer are preempted; the ratio decays without preemptions and comes back at one."""

import math

import pytest

from pagedserve.engine.admission import DECAY_STEPS, AdmissionHeadroom
from pagedserve.engine.config import SchedulerConfig
from pagedserve.engine.messages import SequenceId
from tests.scheduler.scripted_runner import reference_output
from tests.scheduler.test_scheduler import assert_all_free, make_engine, request, run_to_completion


def first_step(engine) -> dict[str, list[int]]:
    """One step; the tokens it output, by request (for ``run_to_completion`` to go on from)."""
    outputs: dict[str, list[int]] = {}
    for out in engine.step():
        outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
    return outputs


def test_ratio_falls_to_a_seventh_over_600_quiet_iterations_and_comes_back_at_a_preemption():
    headroom = AdmissionHeadroom(0.7)
    for _ in range(DECAY_STEPS // 2):
        headroom.end_iteration(0)
    assert headroom.ratio == pytest.approx(0.4)
    for _ in range(DECAY_STEPS):
        headroom.end_iteration(0)
    assert headroom.ratio == pytest.approx(0.1)  # the floor
    headroom.end_iteration(2)
    assert headroom.ratio == 0.7
    zero = AdmissionHeadroom(0.0)
    zero.end_iteration(0)
    assert zero.ratio == 0.0


def test_admission_keeps_room_for_growth_and_nothing_is_preempted():
    """10 blocks of 4 slots, 5 requests of 6 prompt tokens and 12 to generate (18 slots: 5 blocks each).
    r0 takes 2 blocks and keeps 2 for its growth (6 + 0.7 x 12 = 14 slots: 4 blocks); r1 needs 4 with
    its own growth, 4 + 2 <= 8 free; r2 would need 4 + 4 > 6: it waits. Admitting whatever fits (the
    same requests, headroom 0) preempts; both give each request its exact tokens."""
    engine, runners = make_engine({"w0": 10}, max_num_seqs=8)
    reqs = [request(f"r{i}", 6, 12, t=i) for i in range(5)]
    for r in reqs:
        engine.add_request(r)
    outputs = first_step(engine)
    assert [n.request_id for n in runners["w0"].plans[0].new_requests] == ["r0", "r1"]
    run_to_completion(engine, outputs)
    assert engine.scheduler.stats().num_preemptions == 0
    for r in reqs:
        assert outputs[r.request_id] == reference_output(list(r.prompt_token_ids), 12)
    assert_all_free(engine)

    eager, _ = make_engine({"w0": 10}, max_num_seqs=8, admission_headroom=0.0)
    for r in reqs:
        eager.add_request(r)
    assert run_to_completion(eager) == outputs and eager.scheduler.stats().num_preemptions > 0


def test_a_worker_running_nothing_admits_what_fits_whatever_its_growth():
    """A request whose growth alone exceeds the cache still runs when nothing else does (it never waits
    for ever): 6 prompt tokens and up to 100 more in 10 blocks of 4 slots."""
    engine, runners = make_engine({"w0": 10}, max_num_seqs=8)
    engine.add_request(request("long", 6, 100))
    engine.add_request(request("next", 6, 4, t=1))
    outputs = first_step(engine)
    assert [n.request_id for n in runners["w0"].plans[0].new_requests] == ["long"]
    assert engine.scheduler.sequence(SequenceId("next")).num_preemptions == 0
    run_to_completion(engine, outputs)
    assert_all_free(engine)


@pytest.mark.parametrize("value", [-0.1, 1.5, math.nan])
def test_headroom_outside_zero_to_one_is_refused(value):
    with pytest.raises(ValueError, match="admission_headroom must be between 0 and 1"):
        SchedulerConfig(admission_headroom=value)
