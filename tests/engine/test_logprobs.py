"""The chosen token's logprob, rank and top alternatives (engine/logprobs.py): exact values against a
float64 log-softmax, and tokens at -inf (ruled out by a grammar or min_tokens) never listed."""

from __future__ import annotations

import math

import torch

from pagedserve.engine.logprobs import token_logprobs


def test_alternatives_are_the_most_likely_with_the_chosen_tokens_rank():
    logits = torch.tensor([[2.0, 0.5, 3.0, -1.0], [0.5, 0.0, 1.0, 4.0]])  # no ties: topk's order among them is free
    got = token_logprobs(logits, torch.tensor([1, 3]), [2, 3])
    want = torch.log_softmax(logits.double(), dim=-1)
    assert [e.rank for e in got] == [3, 1]
    assert got[0].top_token_ids == (2, 0) and got[1].top_token_ids == (3, 2, 0)
    assert math.isclose(got[0].logprob, want[0, 1].item(), abs_tol=1e-6)
    assert all(math.isclose(v, want[1, t].item(), abs_tol=1e-6) for t, v in zip(got[1].top_token_ids,
                                                                                  got[1].top_logprobs))


def test_tokens_ruled_out_are_never_alternatives_however_many_are_asked_for():
    """Two tokens possible, five asked for: two listed. Before, three of the -inf tokens were listed too,
    and which three changed with the batch (ties)."""
    logits = torch.full((2, 8), -math.inf)
    logits[0, [5, 2]] = torch.tensor([1.0, 0.0])
    logits[1, 7] = 0.0
    got = token_logprobs(logits, torch.tensor([5, 7]), [5, 5])
    assert got[0].top_token_ids == (5, 2) and got[1].top_token_ids == (7,) and got[1].top_logprobs == (0.0,)
    assert all(v > -math.inf for e in got for v in e.top_logprobs)
    assert [e.rank for e in got] == [1, 1]
