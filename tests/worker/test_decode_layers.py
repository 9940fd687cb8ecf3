"""The C++ decode-step layer loop (models/decode_layers.py): logits and K/V caches bit-identical to the
Python layers over several decode steps, with oneDNN's and the panel GEMM's linear layers, at 1 row
(oneDNN's padded row), a few rows (bfloat16's few-row kernel) and many, with q/k/v biases (Qwen2), on shuffled block tables; the Python layers wherever it
does not apply."""

from __future__ import annotations

import random

import pytest
import torch

from pagedserve.engine.attention.cpu_backend import CpuAttentionBackend
from pagedserve.engine.attention.cpu_op import load_cpu_attention_op
from pagedserve.engine.config import GemmBackend
from pagedserve.engine.cpu_features import cpu_flags
from pagedserve.engine.models import decode_layers as decode_layers_module
from pagedserve.engine.models.decode_layers import DecodeLayers, decode_layers_available
from pagedserve.engine.models import onednn
from pagedserve.engine.models.onednn import FEW_ROWS, pack_linear_layers
from pagedserve.engine.models.panel_gemm import panels_available
from pagedserve.engine.weight_loader import load_model
from tests.worker.tiny_models import forward_step, make_cache, save_tiny_model

pytestmark = pytest.mark.skipif(not decode_layers_available() or load_cpu_attention_op() is None,
                                reason="needs a C++ compiler")

BLOCK_SIZE = 4
DTYPES = [torch.float32] + ([torch.bfloat16] if {"avx512_bf16", "amx_bf16"} & cpu_flags() else [])
GEMMS = [GemmBackend.ONEDNN] + ([GemmBackend.PANELS] if panels_available() else [])


def _packed_model(tmp_path, arch: str, dtype: torch.dtype, gemm: GemmBackend = GemmBackend.ONEDNN):
    model = load_model(save_tiny_model(tmp_path / arch, arch), dtype=dtype)
    pack_linear_layers(model, gemm)
    model.use_decode_layers()
    return model


@pytest.fixture
def loop_calls(monkeypatch) -> list[int]:
    """Counts the loop's runs (the tokens of each)."""
    calls: list[int] = []
    run = DecodeLayers.__call__

    def counted(self, x, cos, sin, attention):
        calls.append(x.shape[0])
        return run(self, x, cos, sin, attention)

    monkeypatch.setattr(DecodeLayers, "__call__", counted)
    return calls


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("num_seqs", [1, 3, FEW_ROWS + 4])
@pytest.mark.parametrize("gemm", GEMMS, ids=lambda g: g.value)
def test_decode_steps_are_bit_identical_to_the_python_layers(tmp_path, monkeypatch, loop_calls, dtype, arch, num_seqs,
                                                            gemm):
    monkeypatch.setattr(onednn, "few_rows", lambda: FEW_ROWS)  # past it oneDNN's, on every CPU (without AMX: 256)
    model = _packed_model(tmp_path, arch, dtype, gemm)
    loop = model.decode_layers
    assert loop is not None
    backend = CpuAttentionBackend(load_cpu_attention_op())
    rng = random.Random(num_seqs)
    blocks = list(range(1, 96))
    rng.shuffle(blocks)
    tables = [[blocks.pop() for _ in range(6)] for _ in range(num_seqs)]  # 24 slots each
    prompts = [[rng.randrange(96) for _ in range(rng.randrange(3, 11))] for _ in range(num_seqs)]
    caches = {"loop": make_cache(model, 96, BLOCK_SIZE), "python": make_cache(model, 96, BLOCK_SIZE)}
    for name, cache in caches.items():  # prefills: the Python layers on both sides
        forward_step(model, cache, backend, prompts, [0] * num_seqs, tables)
    assert loop_calls == []
    lengths = [len(p) for p in prompts]
    for step in range(4):
        tokens = [[rng.randrange(96)] for _ in range(num_seqs)]
        model.decode_layers = loop
        got = forward_step(model, caches["loop"], backend, tokens, lengths, tables)
        model.decode_layers = None
        want = forward_step(model, caches["python"], backend, tokens, lengths, tables)
        assert torch.equal(got, want), f"step {step}"
        lengths = [n + 1 for n in lengths]
    assert loop_calls == [num_seqs] * 4
    for kind in ("key_caches", "value_caches"):
        for got_layer, want_layer in zip(getattr(caches["loop"], kind), getattr(caches["python"], kind)):
            assert torch.equal(got_layer, want_layer)


def test_a_step_with_a_prefill_in_it_runs_the_python_layers(tmp_path, loop_calls):
    model = _packed_model(tmp_path, "llama", torch.float32)
    cache = make_cache(model, 16, BLOCK_SIZE)
    backend = CpuAttentionBackend(load_cpu_attention_op())
    forward_step(model, cache, backend, [[1, 2, 3]], [0], [[5, 6]])
    forward_step(model, cache, backend, [[4], [7, 8]], [3, 0], [[5, 6], [9]])  # a decode beside a prefill
    assert loop_calls == []
    forward_step(model, cache, backend, [[5]], [4], [[5, 6]])
    assert loop_calls == [1]


@pytest.mark.parametrize("arch", ["qwen3", "mixtral", "gpt_neox"])
def test_other_layer_structures_get_no_loop(tmp_path, arch):
    model = _packed_model(tmp_path, arch, torch.float32)
    assert getattr(model, "decode_layers", None) is None


def test_unpacked_linear_layers_or_no_library_get_no_loop(tmp_path, monkeypatch):
    model = load_model(save_tiny_model(tmp_path / "llama", "llama"), dtype=torch.float32)
    assert DecodeLayers.build(model) is None  # F.linear layers: --gemm-backend torch
    pack_linear_layers(model)
    assert DecodeLayers.build(model) is not None
    monkeypatch.setattr(decode_layers_module, "decode_layers_available", lambda: False)
    assert DecodeLayers.build(model) is None
