"""GPT-NeoX and rotary Falcon (ALiBi Falcon: test_falcon_alibi.py) against transformers: ragged prefill, prefill over cached context and
decode batches (logits within 1e-4), the engine's greedy output vs HF generate, config refusals and
checkpoint errors."""

from __future__ import annotations

import random

import pytest
import torch

from pagedserve.engine.attention import TorchAttentionBackend
from pagedserve.engine.model_info import load_model_info
from pagedserve.engine.models.registry import load_model_config
from pagedserve.engine.models.checkpoint_map import grouped_qkv_order
from pagedserve.engine.weight_loader import WeightLoadError, iter_checkpoint, load_model
from tests.worker.tiny_models import (forward_step, hf_greedy, hf_logits, hf_model, make_cache, relative_errors,
                                      rewrite_config, save_tiny_model, save_tiny_tokenizer)

TOL = 1e-4

CASES = {
    "neox_parallel_rot25": ("gpt_neox", {"use_parallel_residual": True, "rotary_pct": 0.25}),
    "neox_parallel_rot100": ("gpt_neox", {"use_parallel_residual": True, "rotary_pct": 1.0}),
    "neox_sequential_rot25": ("gpt_neox", {"use_parallel_residual": False, "rotary_pct": 0.25}),
    "neox_sequential_rot100_tied": ("gpt_neox", {"use_parallel_residual": False, "rotary_pct": 1.0,
                                                 "tie_word_embeddings": True}),
    "falcon_new_gqa": ("falcon", {}),
    "falcon_new_gqa_one_ln": ("falcon", {"num_ln_in_parallel_attn": 1, "bias": False}),
    "falcon_mqa_parallel": ("falcon", {"new_decoder_architecture": False, "multi_query": True,
                                       "parallel_attn": True, "bias": False}),
    "falcon_mha_sequential_untied": ("falcon", {"new_decoder_architecture": False, "multi_query": False,
                                                "num_kv_heads": 4, "parallel_attn": False, "tie_word_embeddings": False}),
}


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 96) for _ in range(n)]


def _check(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    rel, rel_max = relative_errors(got, ref)
    assert rel < TOL and rel_max < TOL, (what, rel, rel_max)


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(tmp_path, case):
    """Ragged prefill of 3 sequences, then a prefill over cached context (two of them), then 3 decode
    batches; every token's logits vs transformers on the whole sequence."""
    arch, overrides = CASES[case]
    folder = save_tiny_model(tmp_path, arch, **overrides)
    ours, ref_model = load_model(folder), hf_model(folder)
    seqs = [_tokens(n, seed) for n, seed in ((16, 1), (13, 2), (24, 3))]
    refs = [hf_logits(ref_model, s) for s in seqs]
    cache, backend = make_cache(ours, 48, 4), TorchAttentionBackend()
    blocks = random.Random(0).sample(range(48), 24)
    tables = [blocks[0:8], blocks[8:16], blocks[16:24]]  # shuffled, non-contiguous

    def step(chunks: dict[int, tuple[int, int]], what: str) -> None:
        ids = [seqs[i][a:b] for i, (a, b) in chunks.items()]
        got = forward_step(ours, cache, backend, ids, [a for a, _ in chunks.values()],
                           [tables[i] for i in chunks])
        offset = 0
        for i, (a, b) in chunks.items():
            _check(got[offset:offset + b - a], refs[i][a:b], f"{what} seq {i}")
            offset += b - a

    step({0: (0, 9), 1: (0, 7), 2: (0, 5)}, "ragged prefill")
    step({0: (9, 13), 2: (5, 21)}, "prefill over cached context")
    step({1: (7, 10)}, "prefill over cached context")
    for k in range(3):
        step({0: (13 + k, 14 + k), 1: (10 + k, 11 + k), 2: (21 + k, 22 + k)}, f"decode batch {k}")


def test_qkv_relayout_orders():
    """NeoX/Falcon ``[H, 3, D]`` and Falcon's grouped rows map onto ``[q; k; v]``; multi-query is the identity."""
    order = grouped_qkv_order(2, 2, 1)  # rows q0 k0 v0 q1 k1 v1
    assert order.tolist() == [0, 3, 1, 4, 2, 5]
    order = grouped_qkv_order(4, 2, 1)  # rows q0 q1 k0 v0 q2 q3 k1 v1
    assert order.tolist() == [0, 1, 4, 5, 2, 6, 3, 7]
    assert grouped_qkv_order(4, 1, 2).tolist() == list(range(12))


@pytest.mark.parametrize("case", ["neox_parallel_rot25", "neox_sequential_rot100_tied", "falcon_new_gqa",
                                  "falcon_mqa_parallel"])
def test_engine_greedy_matches_hf_generate(tmp_path, case):
    """``LLM`` (prefix caching on, block size 4) on 8 prompts together equals HF greedy generate;
    the 8 share prefixes with a request run before them, so their prefills start over cached blocks."""
    from pagedserve.engine.sampling_params import SamplingParams
    from pagedserve.llm import LLM

    arch, overrides = CASES[case]
    folder = save_tiny_tokenizer(save_tiny_model(tmp_path, arch, **overrides))
    shared = _tokens(12, 7)
    prompts = [shared + _tokens(n, 10 + n) for n in (1, 3, 5, 9)] + [_tokens(n, 20 + n) for n in (2, 6, 11, 17)]
    ref_model = hf_model(folder)
    num_tokens = 10
    reference = [hf_greedy(ref_model, p, num_tokens) for p in prompts]
    llm = LLM(folder, kv_cache_memory="4MiB", block_size=4, enable_prefix_caching=True)
    params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    warm = llm.generate([shared + [5, 6, 7, 8]], params)
    assert list(warm[0].token_ids) == hf_greedy(ref_model, shared + [5, 6, 7, 8], num_tokens)
    results = llm.generate(prompts, params)
    assert llm.stats().prefix_cache_hits >= 4 * 12, "the shared 12-token prefix (3 blocks) came from the cache"
    for i, result in enumerate(results):
        assert list(result.token_ids) == reference[i], f"prompt {i}"


def test_configs_parsed(tmp_path):
    neox = load_model_config(save_tiny_model(tmp_path / "neox", "gpt_neox", rotary_pct=0.25))
    assert (neox.head_dim, neox.rotary_dim, neox.num_kv_heads, neox.use_parallel_residual) == (16, 4, 4, True)
    legacy = tmp_path / "neox"
    rewrite_config(legacy, rope_parameters=None, rotary_pct=0.5, rotary_emb_base=500.0)
    old = load_model_config(legacy)
    assert (old.rotary_dim, old.rope.theta) == (8, 500.0)
    mqa = load_model_config(save_tiny_model(tmp_path / "mqa", "falcon", new_decoder_architecture=False))
    assert (mqa.num_kv_heads, mqa.parallel_attn, mqa.num_layernorms, mqa.tie_word_embeddings) == (1, True, 1, True)
    rewrite_config(tmp_path / "mqa", num_attention_heads=None, n_head=4, num_hidden_layers=None, n_layer=2)
    assert load_model_config(tmp_path / "mqa").num_layers == 2
    info = load_model_info(tmp_path / "mqa")  # what the tokenizer and services read, without torch
    assert (info.architecture, info.num_layers, info.num_kv_heads, info.head_dim) == ("FalconForCausalLM", 2, 1, 16)


@pytest.mark.parametrize("arch", ["gpt_neox", "falcon"])
def test_checkpoint_errors(tmp_path, arch):
    folder = save_tiny_model(tmp_path, arch)
    tensors = dict(iter_checkpoint(folder))
    model_class = type(load_model(folder))
    config = load_model_config(folder)
    qkv = next(n for n in tensors if n.endswith("0.attention.query_key_value.weight")
               or n.endswith("0.self_attention.query_key_value.weight"))

    def load(items):
        model_class(config).load_checkpoint(items.items())

    with pytest.raises(WeightLoadError, match="lacks tensors for: layers.0.*qkv_proj.weight"):
        load({k: v for k, v in tensors.items() if k != qkv})
    with pytest.raises(WeightLoadError, match="no parameter for checkpoint tensors: extra.weight"):
        load({**tensors, "extra.weight": torch.zeros(3)})
    with pytest.raises(WeightLoadError, match="has shape"):
        load({**tensors, qkv: tensors[qkv][:-1]})


@pytest.mark.parametrize("case", ["neox_parallel_rot25", "falcon_mqa_parallel"])
def test_onednn_and_compiled_forward_match_eager(tmp_path, case):
    """``--gemm-backend onednn`` packs every Linear (the tied LM head included) and ``torch.compile``
    traces the forward; both give the eager logits on a ragged prefill then a decode batch."""
    from pagedserve.engine.models.compiled import CompiledForward
    from pagedserve.engine.models.onednn import pack_linear_layers

    arch, overrides = CASES[case]
    folder = save_tiny_model(tmp_path, arch, **overrides)
    eager, packed = load_model(folder), load_model(folder)
    assert pack_linear_layers(packed) == 4 * eager.config.num_layers + 1
    compiled = CompiledForward(eager)
    steps = [([_tokens(9, 1), _tokens(4, 2)], [0, 0]), ([[5], [6]], [9, 4])]
    caches = [make_cache(eager, 16, 4) for _ in range(3)]
    tables = [[3, 9, 1, 12], [7, 0, 14, 2]]
    for token_ids, context_lens in steps:
        want = forward_step(eager, caches[0], TorchAttentionBackend(), token_ids, context_lens, tables)
        for model, cache, forward in ((packed, caches[1], None), (eager, caches[2], compiled)):
            got = forward_step(model, cache, TorchAttentionBackend(), token_ids, context_lens, tables, forward)
            _check(got, want, f"{case} {context_lens}")


def test_neox_legacy_buffers_skipped_and_lm_head_alias(tmp_path):
    """Old Pythia files carry causal-mask and inv_freq buffers (skipped); ``lm_head.weight``
    (transformers 5's name) fills the LM head like ``embed_out.weight``, and both at once is an error."""
    folder = save_tiny_model(tmp_path, "gpt_neox")
    tensors = dict(iter_checkpoint(folder))
    model = load_model(folder)
    extra = {"gpt_neox.layers.0.attention.bias": torch.ones(1, 1, 8, 8),
             "gpt_neox.layers.0.attention.masked_bias": torch.tensor(-1e9),
             "gpt_neox.layers.0.attention.rotary_emb.inv_freq": torch.ones(2)}
    renamed = {("lm_head.weight" if k == "embed_out.weight" else k): v for k, v in tensors.items()}
    fresh = type(model)(model.config)
    fresh.load_checkpoint({**renamed, **extra}.items())
    assert torch.equal(fresh.lm_head.weight, model.lm_head.weight)
    with pytest.raises(WeightLoadError, match="appears twice"):
        type(model)(model.config).load_checkpoint({**tensors, "lm_head.weight": tensors["embed_out.weight"]}.items())
