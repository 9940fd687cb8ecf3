"""The default model (SmolLM2-135M: 9 query heads, 3 KV heads) over TP = 3 ranks, each with 3 query
heads and 1 KV head: the same greedy tokens as one rank (about 15 s on two cores)."""

from __future__ import annotations

import pytest

from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.llm import LLM
from tests.engine.conftest import BASE_PROMPTS

pytestmark = pytest.mark.model
GREEDY = SamplingParams(max_tokens=16, temperature=0.0)


def test_tp3_greedy_equals_one_rank(default_model, default_llm):
    prompts = BASE_PROMPTS[:8]
    single = [list(r.token_ids) for r in default_llm.generate(prompts, GREEDY)]
    with LLM(default_model, kv_cache_memory="64MiB", tensor_parallel_size=3) as llm:
        assert [list(r.token_ids) for r in llm.generate(prompts, GREEDY)] == single
