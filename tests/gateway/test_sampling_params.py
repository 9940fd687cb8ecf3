"""SamplingParams.to_engine: what reaches the engine."""

from __future__ import annotations

import pytest

from pagedserve.engine.sampling_params import SamplingParams


@pytest.mark.parametrize("temperature,expected", [(1e-45, 0.0), (9e-6, 0.0), (1e-5, 1e-5), (0.7, 0.7)])
def test_temperatures_below_1e_5_sample_greedily(temperature, expected):
    """Review finding: 1e-45 passed validation and dividing logits by it overflowed them to inf."""
    engine = SamplingParams(max_tokens=4, temperature=temperature).to_engine(3, 100, 50, (2,))
    assert engine.temperature == pytest.approx(expected) and engine.is_greedy == (expected == 0.0)
