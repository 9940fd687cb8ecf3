"""The oneDNN linear layers (the default GEMMs on CPU, but for float32 layers where the panel GEMM is
preferred): same products as F.linear to float32 rounding, on every layer; each row's result independent
of the batch's size; ``auto`` resolved."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import logging

from pagedserve.engine.config import GemmBackend
from pagedserve.engine.cpu_features import ONEDNN_BF16_CPU_FLAGS, cpu_flags
from pagedserve.engine.models.layers import Linear
from pagedserve.engine.models.onednn import (FEW_ROWS, FEW_ROWS_AMD, MIN_ROWS, OneDnnLinear, few_rows_limit,
                                             pack_linear_layers, resolve_gemm_backend)
from pagedserve.engine.models.panel_gemm import panels_available, panels_preferred

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch without oneDNN")


@pytest.mark.parametrize("num_tokens", [1, 5, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_onednn_linear_matches_f_linear(num_tokens, bias):
    g = torch.Generator().manual_seed(num_tokens)
    weight = torch.randn(96, 80, generator=g)
    b = torch.randn(96, generator=g) if bias else None
    x = torch.randn(num_tokens, 80, generator=g)
    got = OneDnnLinear(weight, b)(x)
    assert got.shape == (num_tokens, 96) and got.dtype == torch.float32
    torch.testing.assert_close(got, F.linear(x, weight, b), rtol=1e-5, atol=1e-5)


def test_eager_calls_skip_the_custom_op_and_compiled_ones_keep_it():
    """The custom op's dispatch costs more than a small GEMM (70-110 us a call on the 2-core Xeon), so
    eager forwards call the packed GEMM directly; under torch.compile the op stays opaque."""
    layer = OneDnnLinear(torch.randn(96, 80, generator=torch.Generator().manual_seed(0)), None)
    x = torch.randn(3, 80, generator=torch.Generator().manual_seed(1))

    def op_calls(fn) -> int:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            fn(x)
        return sum(e.count for e in prof.key_averages() if e.key == "pagedserve::onednn_linear")

    assert op_calls(layer) == 0
    compiled = torch.compile(layer, backend="eager", fullgraph=True)
    compiled(x)  # traces
    assert op_calls(compiled) == 1
    torch.testing.assert_close(compiled(x), layer(x), rtol=0, atol=0)


def test_pack_replaces_every_linear_and_adds_a_tied_lm_head(default_model):
    from pagedserve.engine.weight_loader import load_model

    model = load_model(default_model)
    assert model.lm_head is None  # SmolLM2 ties its LM head to the embeddings
    linears = sum(isinstance(m, Linear) for m in model.modules())
    x = torch.randn(7, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    layer = model.layers[3]
    before = (layer.mlp(x), model.compute_logits(x))
    assert pack_linear_layers(model) == linears + 1 == 4 * model.config.num_layers + 1
    assert not any(isinstance(m, Linear) for m in model.modules())
    assert isinstance(model.lm_head, OneDnnLinear)
    after = (layer.mlp(x), model.compute_logits(x))
    for got, want in zip(after, before):  # float32 rounding of sums over 576..1536 products
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * float(want.abs().max()))
    assert after[1].dtype == torch.float32 and model.embed_tokens.weight.shape[0] == after[1].shape[1]


MODEL_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576))
"""The default model's GEMMs ``[out, in]``: fused QKV, output projection, gate-up, down, LM head."""


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    "amx_bf16" in cpu_flags() or "avx512_bf16" in cpu_flags() or not cpu_flags() & set(ONEDNN_BF16_CPU_FLAGS),
    reason="bfloat16 rows change at 33 rows on CPUs with AMX (oneDNN) and past few_rows() with AVX512_BF16 "
           "(models/onednn.py); oneDNN has no bfloat16 GEMM on CPUs without ONEDNN_BF16_CPU_FLAGS"))])
@pytest.mark.parametrize("out_features, in_features", MODEL_SHAPES)
def test_a_rows_result_does_not_depend_on_the_batch_size(out_features, in_features, dtype):
    """Rows alone, in twos, sevens and 64s are bit-identical to the same rows in a batch of 257 (MKL's
    F.linear is not: scripts/gemm_batch_invariance.py). Without the padding to MIN_ROWS, single rows
    of the 1536-wide down projection differ (oneDNN's GEMV sums in another order)."""
    g = torch.Generator().manual_seed(out_features + in_features)
    layer = OneDnnLinear((torch.randn(out_features, in_features, generator=g) * in_features ** -0.5).to(dtype), None)
    x = torch.randn(257, in_features, generator=g).to(dtype)
    full = layer(x)
    for size in (1, MIN_ROWS, 7, 64):
        for row in range(0, 257, 32):
            start = min(row, 257 - size)
            assert torch.equal(layer(x[start:start + size])[row - start], full[row]), (size, row)


def test_auto_is_panels_or_onednn_on_the_cpu_and_torch_elsewhere(caplog):
    cpu = GemmBackend.PANELS if panels_preferred() else GemmBackend.ONEDNN
    with caplog.at_level(logging.INFO, logger="pagedserve.worker"):
        assert resolve_gemm_backend("auto", "cpu") is cpu
        assert not caplog.records
        assert resolve_gemm_backend(GemmBackend.AUTO, "cuda:1") is GemmBackend.TORCH
    assert "torch GEMMs (F.linear) on cuda:1" in caplog.text
    assert resolve_gemm_backend("torch", "cpu") is GemmBackend.TORCH
    assert resolve_gemm_backend("onednn", "cpu") is GemmBackend.ONEDNN


@pytest.mark.skipif(not panels_available(), reason="needs an x86 CPU with AVX2 and FMA and a C++ compiler")
@pytest.mark.parametrize("flags, vendor, want", [
    ({"avx2", "fma"}, "GenuineIntel", GemmBackend.PANELS),               # no AVX-512: measured faster (Zen 3)
    ({"avx2", "fma", "avx512f"}, "AuthenticAMD", GemmBackend.PANELS),    # AMD's AVX-512: measured (Zen 4)
    ({"avx2", "fma", "avx512f"}, "GenuineIntel", GemmBackend.ONEDNN),    # Intel's AVX-512: not measured
])
def test_auto_takes_the_panel_gemm_where_it_was_measured_faster(monkeypatch, flags, vendor, want):
    from pagedserve.engine.models import panel_gemm

    monkeypatch.setattr(panel_gemm, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(panel_gemm, "cpu_vendor", lambda: vendor)
    assert resolve_gemm_backend("auto", "cpu") is want
    assert resolve_gemm_backend("panels", "cpu") is GemmBackend.PANELS  # chosen explicitly: always taken


def test_panels_where_they_cannot_run_is_refused_with_what_to_use(monkeypatch):
    from pagedserve.engine.models import onednn

    monkeypatch.setattr(onednn, "panels_available", lambda: False)
    with pytest.raises(ValueError, match="needs an x86 CPU with AVX2 and FMA .* use --gemm-backend auto or onednn"):
        resolve_gemm_backend("panels", "cpu")


def test_parallel_ranks_take_auto_as_torch_and_refuse_onednn(caplog):
    from pagedserve.engine.config import CompileMode
    from pagedserve.engine.parallel.launch import check_rank_kernels

    with caplog.at_level(logging.INFO, logger="pagedserve.worker"):
        check_rank_kernels(GemmBackend.AUTO, CompileMode.EAGER)
        check_rank_kernels(GemmBackend.TORCH, CompileMode.EAGER)
    assert [r.getMessage() for r in caplog.records] == [
        "--gemm-backend auto: torch GEMMs (F.linear) on tensor- and pipeline-parallel ranks"]
    for gemm, mode in ((GemmBackend.ONEDNN, CompileMode.EAGER), (GemmBackend.PANELS, CompileMode.EAGER),
                       (GemmBackend.AUTO, CompileMode.INDUCTOR)):
        with pytest.raises(ValueError, match="use gemm_backend 'auto' or 'torch' and compile_mode 'eager'"):
            check_rank_kernels(gemm, mode)


@pytest.mark.parametrize("flags, vendor, limit", [
    ({"avx512_bf16", "amx_bf16", "amx_tile"}, "GenuineIntel", FEW_ROWS),  # the Xeon: measured
    ({"avx512_bf16"}, "AuthenticAMD", FEW_ROWS_AMD),                       # Zen 4: measured
    ({"avx512_bf16"}, "GenuineIntel", FEW_ROWS),                           # Cooper Lake: not measured
])
def test_bfloat16_layers_take_the_few_row_kernel_up_to_what_was_measured_per_cpu(flags, vendor, limit):
    assert few_rows_limit(frozenset(flags), vendor) == limit and (FEW_ROWS, FEW_ROWS_AMD) == (8, 256)
