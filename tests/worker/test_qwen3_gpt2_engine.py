"""Qwen3 and GPT-2 through the whole in-process engine (``pagedserve.llm.LLM``, prefix caching on):
greedy tokens equal Hugging Face ``generate``; with oneDNN GEMMs too; and the compiled forward
(inductor) gives the eager logits."""

from __future__ import annotations

import random

import pytest
import torch

from pagedserve.engine.attention import TorchAttentionBackend
from pagedserve.engine.models.compiled import CompiledForward
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.engine.weight_loader import load_model
from pagedserve.llm import LLM
from tests.worker.tiny_models import (forward_step, hf_greedy, hf_model, make_cache, relative_errors,
                                      save_tiny_model, save_tiny_tokenizer)

MAX_TOKENS = 10
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
ARCHS = ("qwen3", "gpt2")


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tmp_path_factory):
    """(folder, HF model, 8 prompts, HF greedy tokens of each prompt alone)."""
    folder = save_tiny_tokenizer(save_tiny_model(tmp_path_factory.mktemp(request.param), request.param, seed=11))
    rng = random.Random(5)
    shared = [rng.randrange(3, 96) for _ in range(9)]
    prompts = [[rng.randrange(3, 96) for _ in range(n)] for n in (1, 4, 7, 13, 20, 31)]
    prompts += [shared + [17, 18], shared + [40, 41, 42, 43, 44]]  # a common prefix of 2 blocks (+1 token)
    ref = hf_model(folder)
    return folder, ref, prompts, [hf_greedy(ref, p, MAX_TOKENS) for p in prompts]


def test_engine_greedy_matches_hf_generate_with_prefix_caching(tiny):
    """8 prompts together, then again: the second round is served from the prefix cache."""
    folder, _, prompts, reference = tiny
    llm = LLM(folder, kv_cache_memory="4MiB", block_size=4, enable_prefix_caching=True)
    for round_ in range(2):
        results = llm.generate(prompts, GREEDY)
        assert [list(r.token_ids) for r in results] == reference, round_
    assert llm.stats().prefix_cache_hits > 0
    assert all(w.num_free_blocks == w.num_blocks for w in llm.stats().workers)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch without oneDNN")
def test_onednn_gemms_give_the_same_greedy_tokens(tiny):
    folder, _, prompts, reference = tiny
    llm = LLM(folder, kv_cache_memory="4MiB", block_size=4, gemm_backend="onednn")
    assert [list(r.token_ids) for r in llm.generate(prompts, GREEDY)] == reference


def test_compiled_forward_matches_eager(tiny):
    """``--compile-mode inductor``: a ragged prefill, then decodes with a prefill over cached context."""
    folder, _, prompts, _ = tiny
    model = load_model(folder)
    compiled = CompiledForward(model)
    eager_cache, compiled_cache = make_cache(model, 32, 4), make_cache(model, 32, 4)
    tables = [list(range(0, 10)), list(range(10, 20)), list(range(20, 30))]
    a, b, c = prompts[3], prompts[2], prompts[4]
    steps = [([a, b, c], [0, 0, 0]), ([[7], [8], [9]], [13, 7, 20]), ([[3, 4, 5], [10]], [14, 8])]
    for token_ids, context_lens in steps:
        rows = tables[:len(token_ids)]
        want = forward_step(model, eager_cache, TorchAttentionBackend(), token_ids, context_lens, rows)
        got = forward_step(model, compiled_cache, TorchAttentionBackend(), token_ids, context_lens, rows, compiled)
        rel, rel_max = relative_errors(got, want)
        assert rel < 1e-5 and rel_max < 1e-4, (context_lens, rel, rel_max)
