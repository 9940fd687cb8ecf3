"""A seeded request gives the same tokens alone and inside a batch of other requests."""

from __future__ import annotations

import pytest

from pagedserve.llm import LLM
from pagedserve.engine.sampling_params import SamplingParams
from tests.engine.conftest import BASE_PROMPTS

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def llm(default_llm) -> LLM:
    return default_llm


def test_same_seed_same_tokens_alone_and_in_a_batch_of_eight(llm):
    seeded = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)
    prompt = "Tell me something surprising about octopuses."
    alone = llm.generate(prompt, seeded)[0].token_ids
    again = llm.generate(prompt, seeded)[0].token_ids
    others = [SamplingParams(max_tokens=16 + i, temperature=0.9, seed=i) for i in range(4)] + [
        SamplingParams(max_tokens=20, temperature=0.7) for _ in range(4)
    ]
    batch = llm.generate([prompt] + BASE_PROMPTS[:8], [seeded] + others)
    assert alone == again
    assert batch[0].token_ids == alone
    different_seed = llm.generate(prompt, SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, seed=99,
                                                          ignore_eos=True))[0].token_ids
    assert different_seed != alone
