"""``--speculative-control goodput`` (pagedserve/engine/spec_decode/goodput.py): each step verifies the
number of drafts that maximizes expected tokens per second of the step, from the worker's fitted step
cost and the drafts' fill and acceptance rates; a sequence whose step in flight reserved draft slots
waits for its answer whatever the next step drafts."""

from __future__ import annotations

import pytest

from pagedserve.engine.config import SchedulerConfig
from pagedserve.engine.messages import EngineRequest, SampledToken, SequenceId, StepResult
from pagedserve.engine.sampling_params import EngineSamplingParams
from pagedserve.engine.scheduler import Scheduler
from pagedserve.engine.spec_decode.config import SpeculativeConfig
from pagedserve.engine.spec_decode.goodput import DECAY, DraftStats, best_lookahead
from pagedserve.engine.step_cost import StepCost, StepCostModel

# 10 ms a step, 1.5 ms a row: a CPU's decode step of a small model (2 Zen 4 cores: 13.5 ms at 1 row, 105 ms at 54)
CPU = StepCost(fixed_s=0.010, per_token_s=0.0015, per_pair_s=0.0, largest_step_tokens=256)


def stats_with(fill: float, accept: tuple[float, ...], observations: int = 1000) -> DraftStats:
    stats = DraftStats()
    stats.reserved = [float(observations)] * len(accept)
    stats.filled = [fill * observations] * len(accept)
    stats.accepted = [a * fill * observations for a in accept]
    return stats


def test_drafts_are_verified_where_rows_are_cheap_and_not_where_each_costs_a_decode():
    half = stats_with(1.0, (0.5,) * 4)  # every slot filled, half of the drafts accepted
    # batch 1: 1 token in 11.5 ms plain; k = 4: 1 + 2 expected tokens in 17.5 ms
    assert best_lookahead(half, CPU, [100], [100], 4) == 4
    # batch 64: 64 tokens in 106 ms plain; one draft each: 96 tokens in 202 ms
    assert best_lookahead(half, CPU, [100] * 64, [100] * 64, 4) == 0
    # nearly every draft accepted: 64 + 64 * 3.8 tokens in 490 ms beat 64 in 106 ms
    assert best_lookahead(stats_with(1.0, (0.95,) * 4), CPU, [100] * 64, [100] * 64, 4) == 4


def test_only_the_draft_positions_that_pay_are_verified():
    # batch 8 (22 ms plain, 0.364 tokens/ms): the first draft, accepted 90% of the time, pays; the later ones
    # (10% each) lower the step's tokens per second
    assert best_lookahead(stats_with(1.0, (0.9, 0.1, 0.1, 0.1)), CPU, [100] * 8, [100] * 8, 4) == 1


def test_slots_the_proposer_leaves_empty_cost_nothing_and_yield_nothing():
    # a fill rate scales a position's rows and its tokens alike: the choice is the fully filled one's
    for batch in (1, 8, 64):
        full = best_lookahead(stats_with(1.0, (0.6,) * 4), CPU, [100] * batch, [100] * batch, 4)
        assert best_lookahead(stats_with(0.3, (0.6,) * 4), CPU, [100] * batch, [100] * batch, 4) == full


def test_without_a_fitted_cost_every_slot_is_reserved_and_without_speculating_decodes_none():
    assert best_lookahead(DraftStats(), None, [100], [100], 4) == 4
    # steps all alike (a worker that only ever saw one-token prompts: no prefill) fit no fixed cost, and then
    # no draft could ever pay, nor be seen paying: it drafts, which gives the fit steps of other sizes
    assert best_lookahead(stats_with(1.0, (0.9,) * 4), StepCost(0.0, 0.003, 0.0, 256), [100], [100], 4) == 4
    assert best_lookahead(DraftStats(), CPU, [100, 200], [], 4) == 0  # none may draft (structured outputs)


def test_draft_stats_count_per_position_and_decay_towards_every_draft_accepted():
    stats = DraftStats()
    stats.observe([(4, 2, 1), (2, 0, 0)])  # 4 slots, 2 drafts, 1 accepted; 2 slots left empty
    assert (stats.reserved, stats.filled, stats.accepted) == ([2, 2, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0])
    assert stats.fill_rate(0) == (1 + 1) / (2 + 1) and stats.fill_rate(2) == (0 + 1) / (1 + 1)
    assert stats.accept_rate(0) == (1 + 1) / (1 + 1) and stats.accept_rate(1) == (0 + 1) / (1 + 1)
    assert stats.fill_rate(4) == stats.accept_rate(4) == 1.0  # never reserved: the prior
    stats.observe([])  # a step without drafts: what was counted decays
    assert stats.reserved == pytest.approx([2 * DECAY, 2 * DECAY, DECAY, DECAY])
    for _ in range(300):
        stats.observe([])
    assert stats.accept_rate(1) > 0.99  # a workload that stopped drafting is tried again


GREEDY = EngineSamplingParams(max_tokens=20, temperature=0.0)


def make_scheduler(sampling: EngineSamplingParams = GREEDY, budget: int = 64) -> Scheduler:
    config = SchedulerConfig(block_size=4, max_num_batched_tokens=budget, max_plans_in_flight=2,
                             enable_prefix_caching=False, admission_headroom=0.0)
    scheduler = Scheduler(config, SpeculativeConfig(method="ngram", num_speculative_tokens=4, control="goodput"))
    scheduler.add_worker("w0", 16)
    scheduler.add_request(EngineRequest("a", tuple(range(10, 16)), sampling, 0.0))
    return scheduler


def test_a_sequence_whose_step_in_flight_drafts_waits_for_its_answer_even_when_the_next_step_does_not(monkeypatch):
    cost = {"now": CPU}
    monkeypatch.setattr(StepCostModel, "cost", lambda self: cost["now"])
    scheduler = make_scheduler()
    a = SequenceId("a")
    prefill = scheduler.schedule(["w0"]).plans["w0"]
    scheduler.update_from_output({"w0": StepResult(prefill.step_id, (SampledToken(a, 50, 0.0),))})
    drafting = scheduler.schedule(["w0"]).plans["w0"]  # batch 1 on the CPU's cost: every slot pays
    assert drafting.cached_requests[0].num_lookahead_tokens == 4
    cost["now"] = StepCost(fixed_s=0.001, per_token_s=0.010, per_pair_s=0.0, largest_step_tokens=256)  # rows: all
    assert "w0" not in scheduler.schedule(["w0"]).plans  # how many tokens its step yields is in the answer only
    scheduler.update_from_output({"w0": StepResult(drafting.step_id, (SampledToken(a, 51, 0.0, num_draft_tokens=4),))})
    plain = scheduler.schedule(["w0"]).plans["w0"]
    assert plain.cached_requests[0].num_lookahead_tokens == 0  # drafts do not pay now
    ahead = scheduler.schedule(["w0"]).plans["w0"]  # its token in flight, no drafts: it runs ahead as without them
    assert ahead.cached_requests[0].num_computed_tokens == 8


def test_a_seeded_sampled_sequence_drafts_at_every_step_so_its_draws_repeat(monkeypatch):
    # which uniform draws decide its tokens follows where drafts were verified: not the step times
    monkeypatch.setattr(StepCostModel, "cost", lambda self: StepCost(0.001, 0.010, 0.0, 256))  # rows cost all
    scheduler = make_scheduler(EngineSamplingParams(max_tokens=20, temperature=0.8, seed=7))
    a = SequenceId("a")
    prefill = scheduler.schedule(["w0"]).plans["w0"]
    scheduler.update_from_output({"w0": StepResult(prefill.step_id, (SampledToken(a, 50, 0.0),))})
    assert scheduler.schedule(["w0"]).plans["w0"].cached_requests[0].num_lookahead_tokens == 4


def test_the_others_drafts_leave_a_seeded_sequence_its_slots_in_a_tight_token_budget(monkeypatch):
    # 3 greedy decodes and a seeded one, last in line, in a budget of 16: the seeded one's 1 + 4 rows come
    # first, the greedy ones share the 7 rows left (2 slots each), whatever their drafts would be worth
    monkeypatch.setattr(StepCostModel, "cost", lambda self: CPU)  # at batch 4 every slot pays
    scheduler = make_scheduler(budget=16)
    for request_id in "bcd":
        sampling = EngineSamplingParams(max_tokens=20, temperature=0.8, seed=3) if request_id == "d" else GREEDY
        scheduler.add_request(EngineRequest(request_id, (20, 21, 22), sampling, 0.0))
    scheduler.schedule(["w0"])  # the prompt of a (6 tokens) and b, c, d (3 each): 15 of the 16
    scheduler.update_from_output({"w0": StepResult(1, tuple(SampledToken(SequenceId(r), 50, 0.0) for r in "abcd"))})
    plan = scheduler.schedule(["w0"]).plans["w0"]
    assert [(d.seq_id.request_id, d.num_lookahead_tokens) for d in plan.cached_requests] == [
        ("a", 2), ("b", 2), ("c", 2), ("d", 4)]
