"""SamplingParams.to_engine: what reaches the engine."""

from __future__ import annotations

import pytest

from pagedserve.engine.sampling_params import SamplingParams


@pytest.mark.parametrize("temperature,expected", [(1e-45, 0.0), (9e-6, 0.0), (1e-5, 1e-5), (0.7, 0.7)])
def test_temperatures_below_1e_5_sample_greedily(temperature, expected):
    """Review finding: 1e-45 passed validation and dividing logits by it overflowed them to inf."""
    engine = SamplingParams(max_tokens=4, temperature=temperature).to_engine(3, 100, 50, (2,))
    assert engine.temperature == pytest.approx(expected) and engine.is_greedy == (expected == 0.0)


@pytest.mark.parametrize("field,value", [
    ("seed", -1), ("seed", 2**64), ("top_k", 2**31), ("temperature", 1e39), ("top_p", 1e-50),
    ("repetition_penalty", 1e-50), ("repetition_penalty", 1e-40), ("repetition_penalty", float("nan")),
])
def test_values_that_would_not_survive_the_wire_are_refused(field, value):
    """Review finding: the services carry these as uint64, int32 and float32; a seed of -1 failed
    the protobuf encoding (HTTP 500) and a top_p of 1e-50 became 0 there (garbage text)."""
    from pagedserve.engine.sampling_params import InvalidRequestError

    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**{field: value})
    assert info.value.field_name == field  # bare: the gRPC front end adds "sampling_params."


def test_the_extremes_that_survive_the_wire_are_accepted():
    SamplingParams(seed=2**64 - 1, top_k=2**31 - 1, temperature=1e38, top_p=1e-40, repetition_penalty=1e-3)


def test_allowed_ids_that_may_all_be_masked_are_refused_and_a_bad_word_that_cannot_complete_is_not():
    """An allowed id survives every mask unless it is a stop id held back by min_tokens or the last token of a
    bad word whose other tokens are allowed (the output holds allowed ids only)."""
    from pagedserve.engine.sampling_params import InvalidRequestError

    def resolve(params: SamplingParams, bad_words=()):
        return params.to_engine(3, 100, 50, eos_token_ids=(0,), bad_words_token_ids=bad_words)

    with pytest.raises(InvalidRequestError, match="^allowed_token_ids: every allowed id may be masked"):
        resolve(SamplingParams(max_tokens=4, min_tokens=1, allowed_token_ids=[0]))
    with pytest.raises(InvalidRequestError, match="^allowed_token_ids"):
        resolve(SamplingParams(max_tokens=4, allowed_token_ids=[7]), bad_words=((7, 7),))
    assert resolve(SamplingParams(max_tokens=4, allowed_token_ids=[7]), bad_words=((9, 7),)).allowed_token_ids == (7,)
    assert resolve(SamplingParams(max_tokens=4, allowed_token_ids=[0])).allowed_token_ids == (0,)  # no min_tokens
    assert resolve(SamplingParams(max_tokens=4, min_tokens=1, allowed_token_ids=[0, 7])).allowed_token_ids == (0, 7)


def test_min_tokens_beyond_the_context_is_refused_with_or_without_max_tokens():
    """Review 68: min_tokens 100000 without max_tokens was accepted and held EOS back to the end of the
    context (a client's deadline ended it); with max_tokens it was refused already."""
    from pagedserve.engine.sampling_params import InvalidRequestError

    with pytest.raises(InvalidRequestError, match=r"^min_tokens: 98 \+ 3 prompt tokens exceeds the model's context"):
        SamplingParams(min_tokens=98).to_engine(3, 100, 50, (2,))
    with pytest.raises(InvalidRequestError, match="^min_tokens: 10 is more than max_tokens 4"):
        SamplingParams(max_tokens=4, min_tokens=10)
    assert SamplingParams(min_tokens=97).to_engine(3, 100, 50, (2,)).min_tokens == 97
