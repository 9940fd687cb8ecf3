"""Weight loader: fused shards, sharded checkpoints, dtype conversion and clear errors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedserve.engine.models.registry import UnsupportedArchitectureError
from pagedserve.engine.weight_loader import WeightLoadError, load_model
from tests.worker.tiny_models import rewrite_config, save_tiny_model


@pytest.fixture
def folder(tmp_path):
    return save_tiny_model(tmp_path, "qwen2")


def _edit_tensors(folder, edit) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_fused_weights_hold_the_checkpoint_rows(folder):
    model = load_model(folder)
    tensors = load_file(folder / "model.safetensors")
    qkv = model.layers[1].self_attn.qkv_proj
    want = torch.cat([tensors[f"model.layers.1.self_attn.{n}_proj.weight"] for n in "qkv"])
    assert torch.equal(qkv.weight, want)
    assert torch.equal(qkv.bias, torch.cat([tensors[f"model.layers.1.self_attn.{n}_proj.bias"] for n in "qkv"]))
    gate_up = torch.cat([tensors["model.layers.0.mlp.gate_proj.weight"], tensors["model.layers.0.mlp.up_proj.weight"]])
    assert torch.equal(model.layers[0].mlp.gate_up_proj.weight, gate_up)


def test_missing_tensor_is_named(folder):
    _edit_tensors(folder, lambda t: t.pop("model.layers.1.self_attn.k_proj.bias"))
    with pytest.raises(WeightLoadError, match=r"lacks tensors for: layers\.1\.self_attn\.qkv_proj\.bias \(k_proj\)"):
        load_model(folder)


def test_unexpected_tensor_is_named(folder):
    _edit_tensors(folder, lambda t: t.update({"model.layers.0.extra.weight": torch.zeros(2)}))
    with pytest.raises(WeightLoadError, match=r"no parameter for checkpoint tensors: model\.layers\.0\.extra\.weight"):
        load_model(folder)


def test_shape_mismatch_is_named(folder):
    _edit_tensors(folder, lambda t: t.update({"model.norm.weight": torch.ones(3)}))
    with pytest.raises(WeightLoadError, match=r"model\.norm\.weight has shape \(3,\)"):
        load_model(folder)


def test_unknown_architecture_is_named(folder):
    rewrite_config(folder, architectures=["T5ForConditionalGeneration"])
    with pytest.raises(UnsupportedArchitectureError,
                       match="'T5ForConditionalGeneration' is not supported; supported: .*LlamaForCausalLM"):
        load_model(folder)


def test_sharded_checkpoint_and_dtype(folder):
    single = load_model(folder)
    tensors = load_file(folder / "model.safetensors")
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, folder / file, metadata={"format": "pt"})
    (folder / "model.safetensors").unlink()
    index = {"metadata": {}, "weight_map": {n: file for file, part in shards.items() for n in part}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    sharded = load_model(folder)
    for (name, a), (_, b) in zip(single.named_parameters(), sharded.named_parameters()):
        assert torch.equal(a, b), name
    half = load_model(folder, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in half.parameters())
    assert torch.equal(half.norm.weight, single.norm.weight.to(torch.bfloat16))


def test_no_safetensors_file(folder):
    (folder / "model.safetensors").unlink()
    with pytest.raises(WeightLoadError, match="no \\*.safetensors"):
        load_model(folder)
