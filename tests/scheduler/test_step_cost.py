"""Prefill chunks sized by step time (pagedserve/engine/step_cost.py, PlanDraft.chunk_tokens):
exact token counts from a given cost, and the cost fitted from observed steps."""

from __future__ import annotations

import math
import random

import pytest

from pagedserve.engine.step_cost import (StepCost, StepCostModel, StepShape, attention_pairs, fit_step_cost,
                                         prefill_chunk_tokens)
from pagedserve.engine.worker_state import PlanDraft

# 1 ms per token, 1 us per attention (query, key) pair, fitted to steps of up to 4,096 tokens.
COST = StepCost(fixed_s=0.0, per_token_s=1e-3, per_pair_s=1e-6, largest_step_tokens=4096)


def test_attention_pairs_count_the_context_and_the_causal_triangle():
    assert attention_pairs(100, 1) == 101  # a decode reads its context and itself
    assert attention_pairs(0, 4) == 1 + 2 + 3 + 4
    assert attention_pairs(8000, 2) == 2 * 8000 + 3


def test_a_chunk_deep_in_a_long_prompt_gets_fewer_tokens_for_the_same_time():
    # n * 1e-3 + 1e-6 * (n * context + n (n + 1) / 2) <= 0.1 s
    assert prefill_chunk_tokens(COST, 0.1, context=0, limit=4096) == 95  # 95: 0.09956 s; 96: 0.10066 s
    assert prefill_chunk_tokens(COST, 0.1, context=8000, limit=4096) == 11  # 11: 0.09907 s; 12: 0.10808 s
    assert prefill_chunk_tokens(COST, 0.1, context=0, limit=50) == 50  # the token budget still caps it
    assert prefill_chunk_tokens(COST, 0.0005, context=0, limit=50) == 0  # not one token fits


def test_a_chunk_is_not_sized_far_beyond_the_steps_the_cost_was_fitted_to():
    free_prefill = StepCost(fixed_s=0.2, per_token_s=0.0, per_pair_s=0.0, largest_step_tokens=24)  # noisy steps
    assert prefill_chunk_tokens(free_prefill, 0.2, context=0, limit=2048) == 48


def draft_with_decodes(cost: StepCost | None, slowdown: float, decodes: int, budget: int = 256) -> PlanDraft:
    draft = PlanDraft(budget, lambda: cost, slowdown)
    for _ in range(decodes):
        draft.add(context=99, num_new=1)  # 100 pairs each
    return draft


def test_prefill_beside_decodes_gets_the_time_the_slowdown_leaves():
    cost = StepCost(fixed_s=0.1005, per_token_s=1e-3, per_pair_s=0.0, largest_step_tokens=256)
    draft = draft_with_decodes(cost, 2.0, decodes=8)  # the decodes alone: 0.1085 s; the chunks may add as much
    assert draft.token_budget == 248
    assert draft.chunk_tokens(context=0, remaining=5000) == 108
    draft.add(context=0, num_new=108)
    assert draft.chunk_tokens(context=0, remaining=5000) == 0  # the allowance is spent
    assert draft.chunk_tokens(context=500, remaining=1) == 1  # a decode always runs while budget is left


def test_prefill_without_decodes_or_without_a_slowdown_fills_the_token_budget():
    cost = StepCost(fixed_s=0.1005, per_token_s=1e-3, per_pair_s=0.0, largest_step_tokens=256)
    assert draft_with_decodes(cost, 2.0, decodes=0).chunk_tokens(context=0, remaining=5000) == 256
    assert draft_with_decodes(cost, math.inf, decodes=8).chunk_tokens(context=0, remaining=5000) == 248
    assert draft_with_decodes(None, 2.0, decodes=8).chunk_tokens(context=0, remaining=5000) == 248  # no step seen yet
    assert draft_with_decodes(cost, 2.0, decodes=0).chunk_tokens(context=0, remaining=40) == 40


def test_a_share_of_the_prefill_room_caps_the_chunks_of_running_prompts_and_leaves_the_rest():
    cost = StepCost(fixed_s=0.1005, per_token_s=1e-3, per_pair_s=0.0, largest_step_tokens=256)
    draft = draft_with_decodes(cost, 2.0, decodes=8)  # 0.1085 s of prefill time, 248 tokens of budget
    assert draft.chunk_tokens(context=0, remaining=5000, share=0.5, reserve=5000) == 54  # 0.054 of the 0.05425 s
    draft.add(context=0, num_new=54)
    assert draft.chunk_tokens(context=0, remaining=5000, share=0.5, reserve=5000) == 0  # the running prompts' share
    assert draft.chunk_tokens(context=0, remaining=5000) == 54  # what is left is a waiting prompt's
    no_decodes = draft_with_decodes(cost, 2.0, decodes=0)  # the token budget is the room
    assert no_decodes.chunk_tokens(context=0, remaining=5000, share=0.5, reserve=5000) == 128
    no_decodes.add(context=0, num_new=128)
    assert no_decodes.chunk_tokens(context=0, remaining=5000, share=0.5, reserve=5000) == 0
    assert no_decodes.chunk_tokens(context=0, remaining=5000) == 128


def test_a_prompt_leaves_others_no_more_room_than_they_need():
    cost = StepCost(fixed_s=0.1005, per_token_s=1e-3, per_pair_s=0.0, largest_step_tokens=256)
    draft = draft_with_decodes(cost, 2.0, decodes=8)  # 0.1085 s of prefill time, 248 tokens of budget
    assert draft.chunk_tokens(context=0, remaining=5000, share=0.5, reserve=20) == 88  # 0.1085 s less 20 tokens' 0.02
    no_decodes = draft_with_decodes(cost, 2.0, decodes=0)
    assert no_decodes.chunk_tokens(context=0, remaining=5000, share=0.5, reserve=20) == 236  # 256 less 20
    assert no_decodes.chunk_tokens(context=0, remaining=5000, share=0.5, reserve=200) == 128  # half at least


def test_the_first_chunk_gets_a_token_whatever_its_share():
    cost = StepCost(fixed_s=0.1005, per_token_s=1e-3, per_pair_s=0.0, largest_step_tokens=256)
    draft = draft_with_decodes(cost, 2.0, decodes=8, budget=9)  # one token of room: half of it rounds to 0
    assert draft.chunk_tokens(context=0, remaining=5000, share=0.5, reserve=5000) == 1
    draft.add(context=0, num_new=1)
    assert draft.chunk_tokens(context=0, remaining=5000) == 0  # the budget is spent


def test_the_first_chunk_beside_decodes_gets_at_least_one_token():
    cost = StepCost(fixed_s=0.1005, per_token_s=1e-3, per_pair_s=0.0, largest_step_tokens=256)
    draft = draft_with_decodes(cost, 1.0, decodes=8)  # no time at all for prefill
    assert draft.chunk_tokens(context=0, remaining=5000) == 1
    draft.add(context=0, num_new=1)
    # a one-token chunk costs what a decode costs and counts as one: the next prompt gets its token too
    assert draft.chunk_tokens(context=0, remaining=5000) == 1


def test_the_fit_recovers_the_cost_of_noiseless_steps():
    truth = StepCost(fixed_s=0.3, per_token_s=4.7e-3, per_pair_s=8e-7, largest_step_tokens=256)
    chunks = [(248, 0), (120, 2000), (64, 7000), (30, 500)]  # (tokens, context) beside 8 decodes
    shapes = [StepShape(8, 8 * 300, 8)] * 5 + [
        StepShape(8 + n, 8 * 300 + attention_pairs(c, n), 8) for n, c in chunks]
    fitted = fit_step_cost([(s, truth.step_seconds(s.tokens, s.pairs, s.decode_rows)) for s in shapes])
    assert fitted.fixed_s == pytest.approx(0.3, rel=1e-6)
    assert fitted.per_token_s == pytest.approx(4.7e-3, rel=1e-6)
    assert fitted.per_pair_s == pytest.approx(8e-7, rel=1e-6)
    assert fitted.largest_step_tokens == 8 + 248


def test_the_fit_keeps_every_coefficient_non_negative():
    # Faster steps with more context than without: an unconstrained fit would make per_pair negative.
    steps = [(StepShape(100, 1000, 8), 0.5), (StepShape(100, 50_000, 8), 0.45), (StepShape(8, 800, 8), 0.1)]
    fitted = fit_step_cost(steps)
    assert min(fitted.fixed_s, fitted.per_token_s, fitted.per_pair_s) >= 0


def test_before_any_prefill_every_second_counts_as_per_token():
    model = StepCostModel()
    assert model.cost() is None
    model.observe(StepShape(8, 800, 8), 0.4)
    model.observe(StepShape(4, 400, 4), 0.3)
    model.observe(StepShape(0, 0, 0), 0.01)  # a plan that only dropped sequences: ignored
    assert model.cost() == StepCost(0.0, 0.3 / 4, 0.0, largest_step_tokens=8)


@pytest.mark.parametrize("seed", range(5))
def test_decode_steps_keep_the_fit_right_while_a_long_prefill_fills_the_window(seed):
    """Closed loop: every step of a long prefill has a chunk sized to take the same time, so with
    noise (+-15% here) those steps alone fit a model where that time is mostly fixed (prefill looks
    free: 195-554-token chunks) or all per token (18-20). With the decode-only steps kept
    aside, the chunk deep in the prompt stays near the truth's 36 tokens."""
    rng = random.Random(seed)
    truth = StepCost(fixed_s=0.4, per_token_s=3e-3, per_pair_s=1e-6, largest_step_tokens=4096)
    model = StepCostModel()
    for _ in range(16):
        model.observe(StepShape(8, 800, 8), truth.step_seconds(8, 800, 8) * rng.uniform(0.85, 1.15))
    context = 0
    for _ in range(100):  # more than the window of steps with prefill
        chunk = prefill_chunk_tokens(truth, 0.4, context, 4096)
        shape = StepShape(8 + chunk, 800 + attention_pairs(context, chunk), 8)
        model.observe(shape, truth.step_seconds(shape.tokens, shape.pairs, shape.decode_rows) * rng.uniform(0.85, 1.15))
        context += chunk
    assert prefill_chunk_tokens(truth, 0.4, 8000, 4096) == 36
    assert 27 <= prefill_chunk_tokens(model.cost(), 0.4, 8000, 4096) <= 45
