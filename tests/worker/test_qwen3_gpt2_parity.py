"""Qwen3 and GPT-2 against transformers: logits of a ragged prefill, a decode batch and prefills over
cached context (one sharing another sequence's prefix blocks); GPT-2's checkpoint mapping and the
configs each parser refuses."""

from __future__ import annotations

import random

import pytest
import torch

from pagedserve.engine.attention import TorchAttentionBackend
from pagedserve.engine.models.config import ModelConfigError
from pagedserve.engine.models.gpt2 import gpt2_checkpoint_name
from pagedserve.engine.weight_loader import WeightLoadError, iter_checkpoint, load_model
from tests.worker.tiny_models import (forward_step, hf_logits, hf_model, make_cache, relative_errors,
                                      rewrite_config, save_tiny_model)

TOL = 1e-4
BLOCK = 4

CASES = {
    "qwen3_gqa": ("qwen3", {}),
    "qwen3_mqa_tied_bias": ("qwen3", {"num_key_value_heads": 1, "tie_word_embeddings": True, "attention_bias": True}),
    "gpt2": ("gpt2", {}),
    "gpt2_untied_exact_gelu": ("gpt2", {"tie_word_embeddings": False, "activation_function": "gelu", "n_inner": None}),
}


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 96) for _ in range(n)]


def _assert_close(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    rel, rel_max = relative_errors(got, ref)
    assert rel < TOL and rel_max < TOL, (what, rel, rel_max)


def check_ragged_decode_and_cached_context(folder) -> None:
    """Three sequences prefilled together, decoded together, then chunks over their cached context
    plus a new sequence whose first 8 tokens live in the first sequence's blocks (a prefix hit)."""
    ours, ref_model = load_model(folder), hf_model(folder)
    a, b, c = _tokens(1, 16), _tokens(2, 13), _tokens(3, 18)
    d = a[:8] + _tokens(4, 6)
    refs = {name: hf_logits(ref_model, seq) for name, seq in (("a", a), ("b", b), ("c", c), ("d", d))}
    cache, backend = make_cache(ours, 48, BLOCK), TorchAttentionBackend()
    blocks = random.Random(0).sample(range(48), 20)
    ta, tb, tc = blocks[0:5], blocks[5:10], blocks[10:15]
    td = ta[:2] + blocks[15:18]  # a's first two blocks hold d's first 8 tokens
    got = forward_step(ours, cache, backend, [a[:11], b[:5], c[:17]], [0, 0, 0], [ta, tb, tc])
    for (name, lo, hi), rows in zip((("a", 0, 11), ("b", 0, 5), ("c", 0, 17)), got.split([11, 5, 17])):
        _assert_close(rows, refs[name][lo:hi], f"ragged prefill {name}")
    got = forward_step(ours, cache, backend, [[a[11]], [b[5]], [c[17]]], [11, 5, 17], [ta, tb, tc])
    for i, (name, pos) in enumerate((("a", 11), ("b", 5), ("c", 17))):
        _assert_close(got[i], refs[name][pos], f"decode {name}")
    got = forward_step(ours, cache, backend, [a[12:16], b[6:13], d[8:]], [12, 6, 8], [ta, tb, td])
    for (name, lo, hi), rows in zip((("a", 12, 16), ("b", 6, 13), ("d", 8, 14)), got.split([4, 7, 6])):
        _assert_close(rows, refs[name][lo:hi], f"prefill over cached context {name}")


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(tmp_path, case):
    arch, overrides = CASES[case]
    check_ragged_decode_and_cached_context(save_tiny_model(tmp_path, arch, seed=3, **overrides))


def test_qwen3_has_per_head_qk_norm_and_config_head_dim(tmp_path):
    model = load_model(save_tiny_model(tmp_path, "qwen3"))
    attn = model.layers[0].self_attn
    assert model.config.head_dim == 24 and attn.q_norm.weight.shape == (24,) and attn.k_norm.weight.shape == (24,)
    assert attn.qkv_proj.weight.shape == ((4 + 2 * 2) * 24, 64) and attn.qkv_proj.bias is None


def test_gpt2_checkpoint_names():
    assert gpt2_checkpoint_name("transformer.wte.weight") == ("embed_tokens.weight", False)
    assert gpt2_checkpoint_name("wpe.weight") == ("embed_positions.weight", False)
    assert gpt2_checkpoint_name("transformer.ln_f.bias") == ("norm.bias", False)
    assert gpt2_checkpoint_name("transformer.h.3.attn.c_attn.weight") == ("layers.3.attn.c_attn.weight", True)
    assert gpt2_checkpoint_name("h.0.attn.c_attn.bias") == ("layers.0.attn.c_attn.bias", False)
    assert gpt2_checkpoint_name("h.1.mlp.c_proj.weight") == ("layers.1.mlp.c_proj.weight", True)
    assert gpt2_checkpoint_name("h.1.ln_2.weight") == ("layers.1.ln_2.weight", False)
    assert gpt2_checkpoint_name("lm_head.weight") == ("lm_head.weight", False)
    assert gpt2_checkpoint_name("h.0.attn.bias") is None and gpt2_checkpoint_name("h.0.attn.masked_bias") is None


def _gpt2(folder):
    from pagedserve.engine.models.registry import load_model_config
    from pagedserve.engine.models.gpt2 import GPT2LMHeadModel

    return GPT2LMHeadModel(load_model_config(folder))


def test_gpt2_loads_unprefixed_names_and_ignores_mask_buffers(tmp_path):
    """Original OpenAI-style names (no ``transformer.``) and saved ``attn.bias`` masks load the same."""
    folder = save_tiny_model(tmp_path, "gpt2")
    reference = load_model(folder)
    tensors = [(name.removeprefix("transformer."), t) for name, t in iter_checkpoint(folder)]
    tensors.append(("h.0.attn.bias", torch.tril(torch.ones(1, 1, 256, 256))))
    model = _gpt2(folder)
    model.load_checkpoint(tensors)
    for name, param in reference.named_parameters():
        assert torch.equal(param, dict(model.named_parameters())[name]), name


@pytest.mark.parametrize("edit, message", [
    ("drop", "lacks tensors for: layers.1.mlp.c_fc.weight"),
    ("extra", "no parameter for checkpoint tensors: transformer.h.0.attn.q_attn.weight"),
    ("untransposed", r"transformer.h.0.attn.c_attn.weight has shape \(192, 64\); Conv1D \[in, out\] \(64, 192\)"),
    ("bad_bias", r"transformer.h.0.ln_1.bias has shape \(3,\)"),
])
def test_gpt2_checkpoint_that_does_not_fit_is_refused(tmp_path, edit, message):
    folder = save_tiny_model(tmp_path, "gpt2")
    tensors = dict(iter_checkpoint(folder))
    if edit == "drop":
        del tensors["transformer.h.1.mlp.c_fc.weight"]
    elif edit == "extra":
        tensors["transformer.h.0.attn.q_attn.weight"] = torch.zeros(64, 64)
    elif edit == "untransposed":
        tensors["transformer.h.0.attn.c_attn.weight"] = tensors["transformer.h.0.attn.c_attn.weight"].t()
    else:
        tensors["transformer.h.0.ln_1.bias"] = torch.zeros(3)
    with pytest.raises(WeightLoadError, match=message):
        _gpt2(folder).load_checkpoint(tensors.items())


@pytest.mark.parametrize("arch, changes, message", [
    ("gpt2", {"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx=true is not supported"),
    ("gpt2", {"reorder_and_upcast_attn": True}, "reorder_and_upcast_attn=true is not supported"),
    ("gpt2", {"activation_function": "relu"}, "activation_function 'relu' is not supported"),
    ("gpt2", {"n_head": 5}, "n_embd 64 is not a multiple of n_head 5"),
    ("gpt2", {"n_embd": None}, "no 'n_embd'"),
    ("qwen3", {"head_dim": None}, "no 'head_dim'"),
    ("qwen3", {"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
])
def test_unsupported_config_is_refused_with_a_message(tmp_path, arch, changes, message):
    folder = save_tiny_model(tmp_path, arch)
    rewrite_config(folder, **changes)
    with pytest.raises(ModelConfigError, match=message):
        load_model(folder)


@pytest.mark.parametrize("arch, geometry", [("gpt2", (256, 2, 4, 16)), ("qwen3", (256, 2, 2, 24))])
def test_model_info_reads_context_and_kv_geometry(tmp_path, arch, geometry):
    """The services' view of the folder (GPT-2's ``n_positions``/``n_layer``/``n_head``/``n_embd``)
    agrees with the model's config, which sizes the KV cache."""
    from pagedserve.engine.model_info import load_model_info

    folder = save_tiny_model(tmp_path, arch)
    info, config = load_model_info(folder), load_model(folder).config
    assert (info.max_model_len, info.num_layers, info.num_kv_heads, info.head_dim) == geometry
    assert (config.max_position_embeddings, config.num_layers, config.num_kv_heads, config.head_dim) == geometry
