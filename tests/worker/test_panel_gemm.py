"""pagedserve's float32 GEMM (models/panel_gemm.py, csrc/panel_gemm_f32.cpp): within the float32
summation bound of a float64 reference, on widths that are not a multiple of the 16-column panel and
depths cut into several k slices; each row's result the same bits alone, in any batch and on any number
of threads; bad arguments refused with a message."""

from __future__ import annotations

import pytest
import torch

from pagedserve.engine.config import GemmBackend
from pagedserve.engine.cpu_features import ONEDNN_BF16_CPU_FLAGS, cpu_flags
from pagedserve.engine.models.layers import Linear
from pagedserve.engine.models.onednn import OneDnnLinear, pack_linear_layers
from pagedserve.engine.models.huge_pages import HugePageArena
from pagedserve.engine.models.panel_gemm import PanelLinear, panels_available

pytestmark = pytest.mark.skipif(not panels_available(), reason="needs an x86 CPU with AVX2 and FMA and a C++ compiler")

EPS = 2.0 ** -24  # float32's unit roundoff
# (out, in): the default model's q/k/v and down projections, a width of 3 panels + 1 column, a depth of 3
# uneven k slices (601 = 201 + 201 + 199), a single output column, a depth of 1, 7 panels (with AVX-512 a
# block of 4 panels and one of 3 on one thread, 4 | 3 on two).
SHAPES = [(960, 576), (576, 1536), (49, 64), (40, 601), (1, 300), (33, 1), (112, 64)]


def _layer(out_features: int, in_features: int, bias: bool,
           seed: int = 0) -> tuple[PanelLinear, torch.Tensor, torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=g) * in_features ** -0.5
    b = torch.randn(out_features, generator=g) if bias else None
    return PanelLinear(weight, b, HugePageArena()), weight, b


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_products_are_within_the_float32_summation_bound(shape, bias):
    layer, weight, b = _layer(*shape, bias)
    x = torch.randn(13, shape[1], generator=torch.Generator().manual_seed(1))
    got = layer(x).double()
    exact = x.double() @ weight.double().T + (0 if b is None else b.double())
    # a K-term sum of products rounded at each of its K fused multiply-adds, then + bias: |error| <=
    # (K + 1) u sum_k |x_k w_k| + u |bias| (+ the products' own rounding, which a fused multiply-add avoids)
    magnitude = x.double().abs() @ weight.double().abs().T + (0 if b is None else b.double().abs())
    assert ((got - exact).abs() <= (shape[1] + 1) * EPS * magnitude + 1e-30).all()
    assert got.shape == (13, shape[0])


# 257 rows of depth 8192 are 8.4 MB of x: three passes of 90, 90 and 77 rows over the panels
@pytest.mark.parametrize("shape", [*SHAPES, (40, 8192)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_a_row_is_the_same_bits_alone_and_in_any_batch(shape):
    layer, _, _ = _layer(*shape, bias=True)
    x = torch.randn(257, shape[1], generator=torch.Generator().manual_seed(2))
    full = layer(x)
    assert layer(x[:0]).shape == (0, shape[0])
    for size in (1, 2, 5, 6, 7, 64):
        for start in range(0, 257 - size, 37):
            assert torch.equal(layer(x[start:start + size]), full[start:start + size]), (size, start)


def test_a_row_is_the_same_bits_on_one_thread_and_on_two():
    layer, _, _ = _layer(49, 576, bias=True)  # the second thread's panels end with the partial one
    x = torch.randn(40, 576, generator=torch.Generator().manual_seed(3))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = layer(x)
        torch.set_num_threads(2)
        assert torch.equal(layer(x), alone)
    finally:
        torch.set_num_threads(threads)


def test_float32_layers_are_packed_into_panels_and_others_into_onednn():
    model = torch.nn.Module()
    model.proj = Linear(64, 48, True, torch.float32, "cpu")
    model.lm_head = Linear(64, 100, False, torch.float32, "cpu")
    bf16 = bool(cpu_flags() & set(ONEDNN_BF16_CPU_FLAGS))  # oneDNN packs bfloat16 weights only there
    if bf16:
        model.bf16_proj = Linear(64, 48, False, torch.bfloat16, "cpu")  # not `half`: Module.half() is a method
    for p in model.parameters():
        p.data.normal_()
    assert pack_linear_layers(model, GemmBackend.PANELS) == 2 + bf16
    assert isinstance(model.proj, PanelLinear) and isinstance(model.lm_head, PanelLinear)
    assert not bf16 or isinstance(model.bf16_proj, OneDnnLinear)
    x = torch.randn(3, 64)
    assert model.proj.panels.shape == (3, 64, 16)  # 48 columns: 3 panels
    assert model.lm_head.panels.shape == (7, 64, 16)  # 100 columns: 6 panels and one of 4
    assert torch.equal(model.lm_head(x), torch.cat([model.lm_head(x[i:i + 1]) for i in range(3)]))
    assert model.lm_head(x).shape == (3, 100)


@pytest.mark.parametrize("shape", SHAPES + [(17, 13), (32, 8), (16, 7)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_panels_hold_the_weight_column_by_column_sixteen_at_a_time(shape):
    """Panel p, row k holds W[16p .. 16p + 15, k], zeros past the last column: every element placed,
    on depths that are and are not a multiple of the 8-deep blocks the packing transposes."""
    out_features, in_features = shape
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(1))
    layer = PanelLinear(weight, None, HugePageArena())
    num_panels = -(-out_features // 16)
    padded = torch.zeros(num_panels * 16, in_features)
    padded[:out_features] = weight
    assert torch.equal(layer.panels, padded.view(num_panels, 16, in_features).transpose(1, 2))


def test_bad_arguments_are_refused_with_a_message():
    layer, _, _ = _layer(40, 64, bias=True)
    panel_linear = torch.ops.pagedserve_panels.panel_linear
    with pytest.raises(RuntimeError, match="x must be contiguous float32"):
        panel_linear(torch.randn(2, 64).double(), layer.panels, layer.bias, 40)
    with pytest.raises(RuntimeError, match=r"panels must be pack_panels of a \[40, 32\] weight"):
        panel_linear(torch.randn(2, 32), layer.panels, layer.bias, 40)
    with pytest.raises(RuntimeError, match=r"panels must be pack_panels of a \[60, 64\] weight"):
        panel_linear(torch.randn(2, 64), layer.panels, None, 60)
    with pytest.raises(RuntimeError, match=r"bias must be contiguous float32 \[40\]"):
        panel_linear(torch.randn(2, 64), layer.panels, torch.zeros(48), 40)
    with pytest.raises(RuntimeError, match="need K > 0 and N > 0"):
        panel_linear(torch.randn(2, 0), torch.zeros(3, 0, 16), None, 40)
    with pytest.raises(RuntimeError, match="weight must be float32"):
        torch.ops.pagedserve_panels.pack_panels(torch.randn(16, 8).bfloat16(), torch.empty(1, 8, 16))
    with pytest.raises(RuntimeError, match=r"panels must be a contiguous float32 \[3, 8, 16\] tensor on the CPU for a "
                                           r"\[40, 8\] weight"):
        torch.ops.pagedserve_panels.pack_panels(torch.randn(40, 8), torch.empty(2, 8, 16))
