"""Our Llama-family model against transformers: prefill logits and paged decode steps."""

from __future__ import annotations

import random

import pytest
import torch

from pagedserve.engine.attention import TorchAttentionBackend
from pagedserve.engine.weight_loader import load_model
from tests.worker.tiny_models import (forward_step, hf_logits, hf_model, make_cache, relative_errors,
                                      rewrite_config, save_tiny_model)

TOL = 1e-4

ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_theta": 500000.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0},
    "yarn_mscale": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                    "rope_theta": 10000.0, "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 16.0,
                    "truncate": False},
}

CASES = {
    "llama_gqa_untied": ("llama", {}),
    "llama_gqa_tied": ("llama", {"tie_word_embeddings": True}),
    "llama_mha_bias": ("llama", {"num_key_value_heads": 4, "attention_bias": True, "mlp_bias": True}),
    "mistral": ("mistral", {"sliding_window": None}),
    "qwen2": ("qwen2", {"num_key_value_heads": 1}),
    **{f"rope_{name}": ("llama", {"rope_parameters": rope}) for name, rope in ROPES.items()},
}


def _prompt(n: int, seed: int = 1) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 96) for _ in range(n)]


def _check_prefill_and_decode(folder, prompt_len: int = 21, decode_steps: int = 5, block_size: int = 4) -> None:
    ours, ref_model = load_model(folder), hf_model(folder)
    tokens = _prompt(prompt_len + decode_steps)
    ref = hf_logits(ref_model, tokens)
    cache, backend = make_cache(ours, 40, block_size), TorchAttentionBackend()
    table = random.Random(0).sample(range(40), 10)  # shuffled, non-contiguous blocks
    got = forward_step(ours, cache, backend, [tokens[:prompt_len]], [0], [table])
    rel, rel_max = relative_errors(got, ref[:prompt_len])
    assert rel < TOL and rel_max < TOL, (rel, rel_max)
    for pos in range(prompt_len, prompt_len + decode_steps):
        got = forward_step(ours, cache, backend, [[tokens[pos]]], [pos], [table])
        rel, rel_max = relative_errors(got[0], ref[pos])
        assert rel < TOL and rel_max < TOL, (pos, rel, rel_max)


@pytest.mark.parametrize("case", sorted(CASES))
def test_tiny_model_matches_transformers(tmp_path, case):
    arch, overrides = CASES[case]
    _check_prefill_and_decode(save_tiny_model(tmp_path, arch, **overrides))


def test_legacy_rope_scaling_format(tmp_path):
    """Old ``rope_theta`` + ``rope_scaling`` config.json (``type`` key) reads the same as transformers does."""
    folder = save_tiny_model(tmp_path, "llama")
    rewrite_config(folder, rope_parameters=None, rope_theta=20000.0,
                   rope_scaling={"type": "linear", "factor": 3.0})
    model = load_model(folder)
    assert model.config.rope.theta == 20000.0 and model.config.rope.factor == 3.0
    _check_prefill_and_decode(folder)


def test_dynamic_ntk_past_max_position_matches_transformers_cached_decode(tmp_path):
    """Past ``max_position_embeddings`` each new token uses the base for its own length, as
    transformers does when decoding with its cache."""
    folder = save_tiny_model(tmp_path, "llama", max_position_embeddings=24, rope_parameters=ROPES["dynamic"])
    ours, ref_model = load_model(folder), hf_model(folder)
    tokens = _prompt(30)
    cache, backend = make_cache(ours, 16, 4), TorchAttentionBackend()
    table = list(range(16))[::-1]
    forward_step(ours, cache, backend, [tokens[:24]], [0], [table])
    with torch.no_grad():
        out = ref_model(torch.tensor([tokens[:24]]), use_cache=True)
        for pos in range(24, 30):
            out = ref_model(torch.tensor([[tokens[pos]]]), cache=out.cache, use_cache=True)
            got = forward_step(ours, cache, backend, [[tokens[pos]]], [pos], [table])
            rel, rel_max = relative_errors(got[0], out.logits[0, -1])
            assert rel < TOL and rel_max < TOL, (pos, rel, rel_max)


@pytest.mark.model
def test_default_model_matches_transformers():
    from transformers import AutoTokenizer

    from pagedserve.model_files import prepare_default_model

    folder = prepare_default_model()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    text = "The paged KV cache splits each sequence's keys and values into fixed-size blocks, so"
    tokens = tokenizer(text).input_ids
    ours, ref_model = load_model(folder), hf_model(folder)
    ref = hf_logits(ref_model, tokens)
    cache, backend = make_cache(ours, 16, 16), TorchAttentionBackend()
    table = [7, 3, 11, 0]
    prompt_len = len(tokens) - 3
    got = forward_step(ours, cache, backend, [tokens[:prompt_len]], [0], [table])
    rel, rel_max = relative_errors(got, ref[:prompt_len])
    print(f"default model prefill: relative error {rel:.2e}, max-relative error {rel_max:.2e}")
    assert rel < TOL and rel_max < TOL
    for pos in range(prompt_len, len(tokens)):
        got = forward_step(ours, cache, backend, [[tokens[pos]]], [pos], [table])
        rel, rel_max = relative_errors(got[0], ref[pos])
        print(f"default model decode at position {pos}: relative error {rel:.2e}, max-relative {rel_max:.2e}")
        assert rel < TOL and rel_max < TOL, (pos, rel, rel_max)
