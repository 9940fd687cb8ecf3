"""The default model (SmolLM2-135M: 9 query heads, 3 KV heads, 30 layers) over TP = 3 ranks, each
with 3 query heads and 1 KV head, or over PP = 2 stages: the same greedy tokens as one rank (about
15 s each on two cores)."""

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


def test_pp2_with_two_virtual_engines_greedy_equals_one_rank(default_model):
    """PP = 2 (15 layers per stage; the tied embedding on both ends) with two virtual engines."""
    prompts = BASE_PROMPTS[:8]
    single = [list(r.token_ids) for r in LLM(default_model, kv_cache_memory="64MiB").generate(prompts, GREEDY)]
    with LLM(default_model, kv_cache_memory="64MiB", pipeline_parallel_size=2) as llm:
        assert [w.worker_id for w in llm.stats().workers] == ["worker-0/ve0", "worker-0/ve1"]
        assert [list(r.token_ids) for r in llm.generate(prompts, GREEDY)] == single
