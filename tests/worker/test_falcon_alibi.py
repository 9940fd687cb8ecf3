"""Falcon with ALiBi (falcon-rw layout and a multi-query variant) against transformers: ragged
prefill, prefill over cached context and decode batches (logits within 1e-4) with the torch and the
cpu attention backends; the engine's greedy output vs HF generate; the compiled forward."""

from __future__ import annotations

import random

import pytest
import torch

from pagedserve.engine.attention import CpuAttentionBackend, TorchAttentionBackend, cpu_op
from pagedserve.engine.attention.alibi import alibi_slopes
from pagedserve.engine.models.registry import load_model_config
from pagedserve.engine.weight_loader import load_model
from tests.worker.test_neox_falcon_parity import _check, _tokens
from tests.worker.tiny_models import forward_step, hf_greedy, hf_logits, hf_model, make_cache, save_tiny_model, \
    save_tiny_tokenizer

RW = {"alibi": True, "new_decoder_architecture": False, "multi_query": False, "num_kv_heads": 4,
      "parallel_attn": False, "bias": True}  # falcon-rw-1b/7b's layout
CASES = {
    "falcon_rw": RW,
    "falcon_rw_untied": {**RW, "tie_word_embeddings": False},
    # 6 heads (not a power of two: slopes 2^-2..2^-8 then 2^-1, 2^-3), multi-query, parallel block
    "falcon_alibi_mqa_6_heads": {"alibi": True, "new_decoder_architecture": False, "multi_query": True,
                                 "parallel_attn": True, "bias": False, "num_attention_heads": 6,
                                 "hidden_size": 96},
}
OP = cpu_op.load_cpu_attention_op()
BACKENDS = {"torch": TorchAttentionBackend, "cpu": lambda: CpuAttentionBackend(OP)}


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("case", sorted(CASES))
def test_alibi_logits_match_transformers(tmp_path, case, backend):
    """Ragged prefill of 3 sequences, prefills over cached context, then 3 decode batches; every
    token's logits vs transformers on the whole sequence."""
    if backend == "cpu" and OP is None:
        pytest.skip("the C++ op could not be built here")
    folder = save_tiny_model(tmp_path, "falcon", **CASES[case])
    ours, ref_model = load_model(folder), hf_model(folder)
    assert ours.config.alibi and ours.rotary is None
    seqs = [_tokens(n, seed) for n, seed in ((16, 1), (13, 2), (27, 3))]
    refs = [hf_logits(ref_model, s) for s in seqs]
    cache, attention_backend = make_cache(ours, 48, 4), BACKENDS[backend]()
    blocks = random.Random(0).sample(range(48), 24)
    tables = [blocks[0:8], blocks[8:16], blocks[16:24]]  # shuffled, non-contiguous

    def step(chunks: dict[int, tuple[int, int]], what: str) -> None:
        ids = [seqs[i][a:b] for i, (a, b) in chunks.items()]
        got = forward_step(ours, cache, attention_backend, ids, [a for a, _ in chunks.values()],
                           [tables[i] for i in chunks])
        offset = 0
        for i, (a, b) in chunks.items():
            _check(got[offset:offset + b - a], refs[i][a:b], f"{what} seq {i}")
            offset += b - a

    step({0: (0, 9), 1: (0, 7), 2: (0, 5)}, "ragged prefill")
    step({0: (9, 13), 2: (5, 23)}, "prefill over cached context")
    step({1: (7, 10)}, "prefill over cached context")
    for k in range(3):
        step({0: (13 + k, 14 + k), 1: (10 + k, 11 + k), 2: (23 + k, 24 + k)}, f"decode batch {k}")


def test_alibi_config_and_slopes(tmp_path):
    """``alibi: true`` parses (no RoPE); the layers hold transformers' bf16-rounded slopes."""
    folder = save_tiny_model(tmp_path, "falcon", **RW)
    config = load_model_config(folder)
    assert (config.alibi, config.rope, config.num_kv_heads, config.parallel_attn) == (True, None, 4, False)
    slopes = load_model(folder).layers[1].self_attention.alibi_slopes
    assert slopes.dtype == torch.float32
    torch.testing.assert_close(slopes, alibi_slopes(4).bfloat16().float(), rtol=0, atol=0)


@pytest.mark.parametrize("attention_backend", ["torch", "cpu"])
def test_alibi_engine_greedy_matches_hf_generate(tmp_path, attention_backend):
    """``LLM`` (prefix caching on, block size 4) on 8 prompts together equals HF greedy generate;
    the 8 share prefixes with a request run before them, so their prefills start over cached blocks."""
    from pagedserve.engine.sampling_params import SamplingParams
    from pagedserve.llm import LLM

    folder = save_tiny_tokenizer(save_tiny_model(tmp_path, "falcon", **RW))
    shared = _tokens(12, 7)
    prompts = [shared + _tokens(n, 10 + n) for n in (1, 3, 5, 9)] + [_tokens(n, 20 + n) for n in (2, 6, 11, 17)]
    ref_model = hf_model(folder)
    num_tokens = 10
    reference = [hf_greedy(ref_model, p, num_tokens) for p in prompts]
    llm = LLM(folder, kv_cache_memory="4MiB", block_size=4, enable_prefix_caching=True,
              attention_backend=attention_backend)
    params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    warm = llm.generate([shared + [5, 6, 7, 8]], params)
    assert list(warm[0].token_ids) == hf_greedy(ref_model, shared + [5, 6, 7, 8], num_tokens)
    results = llm.generate(prompts, params)
    assert llm.stats().prefix_cache_hits >= 4 * 12, "the shared 12-token prefix (3 blocks) came from the cache"
    for i, result in enumerate(results):
        assert list(result.token_ids) == reference[i], f"prompt {i}"


def test_alibi_compiled_forward_matches_eager(tmp_path):
    """``torch.compile`` traces the ALiBi forward (the slopes reach the opaque attention op as an
    optional tensor argument) and gives the eager logits on a ragged prefill then a decode batch."""
    from pagedserve.engine.models.compiled import CompiledForward

    model = load_model(save_tiny_model(tmp_path, "falcon", **RW))
    compiled = CompiledForward(model)
    caches = [make_cache(model, 16, 4) for _ in range(2)]
    tables = [[3, 9, 1, 12], [7, 0, 14, 2]]
    for token_ids, context_lens in (([_tokens(9, 1), _tokens(4, 2)], [0, 0]), ([[5], [6]], [9, 4])):
        want = forward_step(model, caches[0], TorchAttentionBackend(), token_ids, context_lens, tables)
        got = forward_step(model, caches[1], TorchAttentionBackend(), token_ids, context_lens, tables, compiled)
        _check(got, want, f"compiled {context_lens}")


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("heads", [12, 32])
def test_alibi_non_power_of_two_slopes_long_context(tmp_path, heads, backend):
    """falcon-rw-1b's 32 heads (slopes 2^(-k/4), rounded to bf16) and 12 heads (interleaved slopes):
    a 300-token prefill then a decode over it, vs transformers (which computes slope * position in
    bf16, positions past 256 rounded too: the backends' ``alibi_bf16`` form; a float32 bias is
    1e-2 off here)."""
    if backend == "cpu" and OP is None:
        pytest.skip("the C++ op could not be built here")
    folder = save_tiny_model(tmp_path, "falcon", **{**RW, "num_attention_heads": heads, "num_kv_heads": heads,
                                                    "hidden_size": 16 * heads, "max_position_embeddings": 512})
    ours, ref_model = load_model(folder), hf_model(folder)
    tokens = _tokens(301, 4)
    want = hf_logits(ref_model, tokens)
    cache, table = make_cache(ours, 80, 4), random.Random(1).sample(range(80), 76)
    attention_backend = BACKENDS[backend]()
    _check(forward_step(ours, cache, attention_backend, [tokens[:280]], [0], [table]), want[:280], "prefill")
    _check(forward_step(ours, cache, attention_backend, [tokens[280:300]], [280], [table]), want[280:300],
           "prefill over cached context")
    _check(forward_step(ours, cache, attention_backend, [tokens[300:]], [300], [table]), want[300:], "decode")
