"""The few-row bfloat16 GEMM (models/csrc/few_rows_bf16.cpp): products within bfloat16 rounding of
float64, a row's result independent of the other rows up to few_rows(), the layer's choice of kernel
by row count, and shapes it cannot take left to oneDNN."""

from __future__ import annotations

import pytest
import torch

from pagedserve.engine.models.onednn import FEW_ROWS, OneDnnLinear, few_rows, few_rows_available

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available() or not few_rows_available(),
                                reason="needs AVX512_BF16, a C++ compiler and torch with oneDNN")

SHAPES = ((960, 576), (576, 1536), (48, 10))  # [out, in]: the default model's QKV and down, a tiny odd width


def _layer(out_features: int, in_features: int, bias: bool, seed: int = 0) -> tuple[OneDnnLinear, torch.Tensor, torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(out_features, in_features, generator=g) * in_features ** -0.5).bfloat16()
    b = torch.randn(out_features, generator=g).bfloat16() if bias else None
    return OneDnnLinear(weight, b), weight, b


@pytest.mark.parametrize("out_features, in_features", SHAPES)
@pytest.mark.parametrize("rows", [1, 3, 4, 5, FEW_ROWS])
@pytest.mark.parametrize("bias", [False, True])
def test_few_rows_are_within_bfloat16_rounding_of_float64(out_features, in_features, rows, bias):
    layer, weight, b = _layer(out_features, in_features, bias)
    assert layer.pairs is not None and layer.pairs.shape == (out_features // 16, in_features // 2, 16, 2)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows)).bfloat16()
    got = layer(x)
    assert got.shape == (rows, out_features) and got.dtype == torch.bfloat16
    exact = x.double() @ weight.double().T + (b.double() if bias else 0)
    # float32 sums of exact products (error ~ in * 2^-24 * sum|x w|) rounded once to bfloat16 (2^-8 relative)
    bound = 2 ** -8 * exact.abs() + in_features * 2 ** -22 * (x.double().abs() @ weight.double().abs().T) + 1e-30
    assert ((got.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("out_features, in_features", SHAPES[:2])
def test_a_rows_result_does_not_depend_on_the_other_rows_up_to_few_rows(out_features, in_features):
    limit = few_rows()
    layer, _, _ = _layer(out_features, in_features, bias=True, seed=1)
    x = torch.randn(limit, in_features, generator=torch.Generator().manual_seed(2)).bfloat16()
    together = layer(x)
    for size in sorted({1, 2, 3, 5, 7, min(33, limit - 1), limit - 1}):  # every start of small ones, 3 of others
        starts = range(limit - size + 1) if size < FEW_ROWS else (0, (limit - size) // 2, limit - size)
        for start in starts:
            assert torch.equal(layer(x[start:start + size]), together[start:start + size]), (size, start)


def test_the_layer_runs_few_rows_itself_and_more_rows_through_onednn():
    limit = few_rows()
    layer, weight, _ = _layer(96, 64, bias=False)
    x = torch.randn(limit + 1, 64, generator=torch.Generator().manual_seed(3)).bfloat16()
    few = torch.ops.pagedserve_gemm.few_rows_linear(x[:limit].contiguous(), layer.pairs, None)
    assert torch.equal(layer(x[:limit]), few)
    onednn = torch.ops.mkldnn._linear_pointwise(x, layer.packed_weight, None, "none", [], "")
    assert torch.equal(layer(x), onednn)


def test_shapes_the_kernel_cannot_take_stay_on_onednn():
    g = torch.Generator().manual_seed(4)
    for out_features, in_features in ((40, 64), (48, 9)):  # out not a multiple of 16; odd in
        weight = torch.randn(out_features, in_features, generator=g).bfloat16()
        layer = OneDnnLinear(weight, None)
        assert layer.pairs is None
        x = torch.randn(2, in_features, generator=g).bfloat16()
        torch.testing.assert_close(layer(x).float(), (x.float() @ weight.float().T), rtol=2e-2, atol=2e-2)
    with pytest.raises(RuntimeError, match="multiple of 16 and K even"):
        torch.ops.pagedserve_gemm.pack_pairs(torch.zeros(40, 64, dtype=torch.bfloat16))
    layer, _, _ = _layer(96, 64, bias=False)
    with pytest.raises(RuntimeError, match="packed must be pack_pairs"):
        torch.ops.pagedserve_gemm.few_rows_linear(torch.zeros(2, 32, dtype=torch.bfloat16), layer.pairs, None)


def test_float32_layers_keep_only_the_onednn_weight():
    layer = OneDnnLinear(torch.randn(96, 64), None)
    assert layer.pairs is None and layer.float_bias is None
