"""With the default GEMMs (on CPU the panel GEMM or oneDNN) a request's tokens and logprobs are
bit-identical alone and in a batch: every op of a step computes a row the same whatever the other rows
(the panel GEMM at any row count, models/panel_gemm.py; oneDNN's from two rows up, single rows padded:
``models/onednn.MIN_ROWS``; norms and attention per row or per
sequence). Prefix caching is off and prompts are prefilled whole (a prompt prefilled over a cached prefix
or in chunks gives the same bits where the C++ prefill op runs, float32 on AVX2 without AVX-512:
tests/engine/test_features_exact.py; elsewhere it may differ in the last bits).
(With ``--gemm-backend torch`` none of the first 12 prompts was identical on this machine: MKL's
rows change with the batch's row count, scripts/gemm_batch_invariance.py.)"""

from __future__ import annotations

import pytest

from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.llm import LLM
from tests.engine.conftest import BASE_PROMPTS

pytestmark = pytest.mark.model

PARAMS = SamplingParams(max_tokens=12, temperature=0.0, logprobs=3, ignore_eos=True)


def test_logprobs_alone_equal_batched_bit_for_bit(default_model, tokenizer):
    llm = LLM(default_model, kv_cache_memory="64MiB", enable_prefix_caching=False, max_num_batched_tokens=4096)
    prompts = [tokenizer.encode_prompt(p) for p in BASE_PROMPTS]
    batched = llm.generate(prompts, PARAMS)
    for i, ids in enumerate(prompts):
        alone = llm.generate(ids, PARAMS)[0]
        assert alone.token_ids == batched[i].token_ids, f"prompt {i}"
        for position, (a, b) in enumerate(zip(alone.samples[0].logprobs, batched[i].samples[0].logprobs)):
            assert (a.logprob, a.top_token_ids, a.top_logprobs) == (b.logprob, b.top_token_ids, b.top_logprobs), \
                f"prompt {i}, token {position}"
