"""Penalties and logit_bias on fixed logits: hand computations, HF's RepetitionPenaltyLogitsProcessor."""

from __future__ import annotations

import pytest
import torch

from pagedserve.engine.penalties import TokenHistory, apply_penalties
from pagedserve.engine.sampler import Sampler
from pagedserve.engine.sampling_params import EngineSamplingParams, InvalidRequestError, SamplingParams


def _params(**kw) -> EngineSamplingParams:
    return EngineSamplingParams(max_tokens=10, **kw)


def test_frequency_and_presence_by_hand():
    logits = torch.tensor([[1.0, 2.0, -1.0, 0.5, 3.0]])
    history = TokenHistory([4, 1, 1, 2, 1], num_prompt_tokens=2)  # prompt 4, 1; output 1, 2, 1
    apply_penalties(logits, [_params(frequency_penalty=0.5, presence_penalty=0.25)], [history])
    # token 1: 2 outputs -> 2 - 2*0.5 - 0.25; token 2: 1 output -> -1 - 0.5 - 0.25; token 4: prompt only
    assert logits.tolist() == [[1.0, 0.75, -1.75, 0.5, 3.0]]


def test_repetition_by_hand_and_against_hf():
    from transformers import RepetitionPenaltyLogitsProcessor

    logits = torch.tensor([[1.0, 2.0, -1.0, 0.5, 3.0], [1.0, 2.0, -1.0, 0.5, 3.0]])
    histories = [TokenHistory([4, 2], 1), TokenHistory([0], 1)]
    ours = logits.clone()
    apply_penalties(ours, [_params(repetition_penalty=2.0), _params(repetition_penalty=1.3)], histories)
    assert ours[0].tolist() == [1.0, 2.0, -2.0, 0.5, 1.5]
    hf = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([[0]]), logits[1:].clone())
    assert torch.allclose(ours[1:], hf)


def test_logit_bias_and_untouched_rows():
    logits = torch.zeros(3, 5)
    apply_penalties(logits, [_params(logit_bias=((1, 100.0), (3, -5.5))), _params(), _params(frequency_penalty=1.0)],
                    [TokenHistory([0], 1), TokenHistory([0, 2], 1), TokenHistory([0], 1)])
    assert logits[0].tolist() == [0.0, 100.0, 0.0, -5.5, 0.0]
    assert logits[1].tolist() == [0.0] * 5  # no penalties asked: untouched even with outputs
    assert logits[2].tolist() == [0.0] * 5  # no outputs yet


def test_sampler_applies_them_before_the_greedy_choice():
    sampler = Sampler(seed=0)
    logits = torch.tensor([[5.0, 4.0, 0.0], [5.0, 4.0, 0.0]])
    out = sampler(logits, [_params(temperature=0.0, frequency_penalty=2.0), _params(temperature=0.0, logit_bias=((2, 6.0),))],
                  [1, 0], [TokenHistory([1, 0], 1), TokenHistory([1], 1)])
    assert out.token_ids == [1, 2]
    assert out.token_logprobs == [None, None]


@pytest.mark.parametrize("kw, field", [
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3.0}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"), ({"logit_bias": {5: 101.0}}, "logit_bias[5]"),
    ({"logit_bias": {i: 1.0 for i in range(301)}}, "logit_bias"), ({"logprobs": 21}, "logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"), ({"n": 3, "best_of": 2}, "best_of"), ({"best_of": 65}, "best_of"),
])
def test_invalid_values_name_the_field(kw, field):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kw)
    assert info.value.field_name == field  # bare: the gRPC front end adds "sampling_params."


def test_logit_bias_ids_checked_against_the_vocabulary():
    with pytest.raises(InvalidRequestError, match=r"^logit_bias\[50\]"):
        SamplingParams(logit_bias={50: 1.0}).to_engine(3, 100, 50, (0,))
