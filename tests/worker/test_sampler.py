"""Sampler: greedy, filtered sets of top-k / top-p / min-p, min_tokens, per-request seeds."""

from __future__ import annotations

import math

import pytest
import torch

from pagedserve.engine.sampling_params import EngineSamplingParams
from pagedserve.engine.sampler import Sampler, apply_min_p, apply_top_k_top_p

PROBS = [0.5, 0.25, 0.15, 0.1]


def _params(**kw) -> EngineSamplingParams:
    return EngineSamplingParams(max_tokens=100, **kw)


def _logits(probs=PROBS, rows: int = 1) -> torch.Tensor:
    return torch.tensor([math.log(p) for p in probs]).repeat(rows, 1)


def _kept(logits: torch.Tensor) -> set[int]:
    return set(torch.nonzero(logits[0] > float("-inf")).flatten().tolist())


@pytest.mark.parametrize("top_k, top_p, expected", [
    (2, 1.0, {0, 1}),
    (4, 1.0, {0, 1, 2, 3}),
    (4, 0.7, {0, 1}),        # mass before each token: 0, .5, .75, .9
    (4, 0.8, {0, 1, 2}),
    (4, 0.3, {0}),
    (3, 0.8, {0, 1}),        # within the top 3, renormalised: 0, .556, .833
])
def test_top_k_top_p_sets(top_k, top_p, expected):
    out = apply_top_k_top_p(_logits(), torch.tensor([top_k]), torch.tensor([top_p]))
    assert _kept(out) == expected


def test_top_k_top_p_candidates_are_exact():
    """Filtering among the largest logits, with fallbacks, equals filtering the whole sorted vocabulary."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 500, generator=g) * torch.tensor([[0.5], [1.0], [2.0], [4.0], [8.0], [0.1]])
    top_k = torch.tensor([500, 7, 500, 300, 500, 500])
    top_p = torch.tensor([0.9, 0.8, 0.5, 0.95, 1.0, 0.99])
    full = apply_top_k_top_p(logits, top_k, top_p, candidate_sizes=())
    for sizes in [(4,), (16, 64), (256,)]:
        assert torch.equal(apply_top_k_top_p(logits, top_k, top_p, candidate_sizes=sizes), full), sizes
    assert torch.equal(full[4], logits[4])  # no filter: untouched


def test_flat_nucleus_beyond_the_candidates():
    out = apply_top_k_top_p(torch.zeros(1, 3000), torch.tensor([3000]), torch.tensor([0.9001]))
    assert int((out > float("-inf")).sum()) == 2701  # mass before the 2701st token is 0.9


@pytest.mark.parametrize("min_p, expected", [(0.25, {0, 1, 2}), (0.4, {0, 1}), (0.0, {0, 1, 2, 3}), (1.0, {0})])
def test_min_p_sets(min_p, expected):
    assert _kept(apply_min_p(_logits(), torch.tensor([min_p]))) == expected


@pytest.mark.parametrize("kw, expected", [
    ({"top_k": 2}, {0, 1}),
    ({"top_p": 0.8}, {0, 1, 2}),
    ({"min_p": 0.4}, {0, 1}),
    ({"top_k": 3, "top_p": 0.8}, {0, 1}),
    ({}, {0, 1, 2, 3}),
])
def test_sampled_tokens_stay_in_the_filtered_set(kw, expected):
    sampler = Sampler(seed=0)
    params = [_params(**kw)] * 400
    out = sampler(_logits(rows=400), params, [0] * 400)
    assert set(out.token_ids) == expected  # every kept token drawn at least once in 400 draws
    kept = torch.tensor([PROBS[t] for t in sorted(expected)]).sum()
    for token_id, logprob in zip(out.token_ids, out.logprobs):
        assert logprob == pytest.approx(math.log(PROBS[token_id] / kept), abs=1e-5)


def test_greedy_rows_take_the_argmax_with_zero_logprob():
    logits = torch.tensor([[0.1, 3.0, 2.0], [5.0, -1.0, 4.9]])
    out = Sampler(seed=0)(logits, [_params(temperature=0.0)] * 2, [0, 0])
    assert out.token_ids == [1, 0] and out.logprobs == [0.0, 0.0]


def test_min_tokens_masks_eos_and_stop_tokens():
    logits = torch.tensor([[0.0, 0.0, 9.0, 8.0, 1.0]] * 4)  # EOS 2 first, stop token 3 second
    params = _params(temperature=0.0, min_tokens=3, eos_token_ids=(2,), stop_token_ids=(3,))
    out = Sampler(seed=0)(logits.clone(), [params] * 4, [0, 2, 3, 7])
    assert out.token_ids == [4, 4, 2, 2]
    ignore = _params(temperature=0.0, min_tokens=3, eos_token_ids=(2,), ignore_eos=True)
    assert Sampler(seed=0)(logits[:1].clone(), [ignore], [0]).token_ids == [2]  # EOS would not stop it


def _flat(rows: int, vocab: int = 1000) -> torch.Tensor:
    return torch.zeros(rows, vocab)


def test_same_seed_same_tokens_alone_in_a_batch_and_on_another_worker():
    seeded = _params(seed=1234)
    alone = [Sampler(seed=1)(_flat(1), [seeded], [i]).token_ids[0] for i in range(10)]
    other = _params(temperature=0.7, top_p=0.9)
    for i in range(10):
        batch = [other, _params(temperature=0.0), seeded, _params(seed=99)]
        out = Sampler(seed=i + 7)(_flat(4), batch, [3, 0, i, i])
        assert out.token_ids[2] == alone[i]
    again = [Sampler()(_flat(1), [seeded], [i]).token_ids[0] for i in range(10)]  # a fresh worker
    assert again == alone
    different = [Sampler(seed=1)(_flat(1), [_params(seed=1235)], [i]).token_ids[0] for i in range(10)]
    assert different != alone
    assert len(set(alone)) > 1  # the output index matters, too


def test_unseeded_rows_use_the_sampler_generator():
    a = Sampler(seed=5)(_flat(8), [_params()] * 8, [0] * 8).token_ids
    b = Sampler(seed=5)(_flat(8), [_params()] * 8, [0] * 8).token_ids
    c = Sampler(seed=6)(_flat(8), [_params()] * 8, [0] * 8).token_ids
    assert a == b and a != c


def test_length_mismatch_raises():
    with pytest.raises(ValueError):
        Sampler(seed=0)(_flat(2), [_params()], [0, 0])


def test_allowed_token_ids_restrict_the_choice_greedy_or_sampled():
    sampler = Sampler(seed=0)
    out = sampler(_logits(rows=2), [_params(temperature=0.0, allowed_token_ids=(2, 3)),
                                    _params(temperature=1.0, allowed_token_ids=(3,))], [0, 0])
    assert out.token_ids == [2, 3]


def test_a_bad_word_masks_its_last_token_when_the_output_ends_with_the_rest():
    from pagedserve.engine.penalties import TokenHistory

    words = ((1, 0), (3, 2, 1))  # token 0 after 1; token 1 after 3, 2
    params = [_params(temperature=0.0, bad_words_token_ids=words)] * 3
    histories = [TokenHistory((9, 1), 1), TokenHistory((9, 3), 1), TokenHistory((9, 3, 2), 1)]
    out = Sampler(seed=0)(_logits(rows=3), params, [1, 1, 2], histories)
    assert out.token_ids == [1, 0, 0]  # 0 masked after 1; nothing after 3 alone; 1 masked after 3, 2
    alone = Sampler(seed=0)(_logits(), [_params(temperature=0.0, bad_words_token_ids=((0,),))], [0],
                            [TokenHistory((9,), 1)])
    assert alone.token_ids == [1]  # a one-token word is always masked
