"""The fused row-wise ops (models/csrc/fused_ops.cpp through models/fused_ops.py): the rotary embedding
and SwiGLU's silu(gate) * up bit-identical to their eager forms, RMSNorm within float32 rounding of float64 and within a bfloat16 ulp of
``F.rms_norm``, the residual add exact, a row's result independent of the other rows, and the eager
forms where the op does not apply."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.engine.models import fused_ops
from pagedserve.engine.models.fused_ops import add_rms_norm, apply_rotary, fused_ops_available, rms_norm, silu_and_mul

pytestmark = pytest.mark.skipif(not fused_ops_available(), reason="needs a C++ compiler")

DTYPES = (torch.float32, torch.bfloat16)
EPS = 1e-5


def _rows(rows: int, width: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, width, generator=g) * 3).to(dtype), (torch.randn(width, generator=g) * 0.5 + 1).to(dtype)


def _eager_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _cos_sin(tokens: int, half: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    angles = (torch.arange(tokens) * 37).float()[:, None] / 10000 ** (torch.arange(half).float() / half)
    return angles.cos().to(dtype)[:, None, :], angles.sin().to(dtype)[:, None, :]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 7, 64])
def test_rotary_is_bit_identical_to_the_eager_form_on_a_strided_qkv_view(dtype, tokens):
    heads, kv_heads, dim = 9, 3, 64
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim).to(dtype)
    qk = qkv[:, : (heads + kv_heads) * dim].view(tokens, heads + kv_heads, dim)  # rows strided by the v part
    cos, sin = _cos_sin(tokens, dim // 2, dtype)
    got = apply_rotary(qk, cos, sin)
    assert got.is_contiguous() and got.shape == qk.shape
    assert torch.equal(got, _eager_rotary(qk, cos, sin))


@pytest.mark.parametrize("dtype", DTYPES)
def test_partial_rotary_on_the_first_channels_is_bit_identical(dtype):
    x = torch.randn(5, 4, 64).to(dtype)
    cos, sin = _cos_sin(5, 8, dtype)
    assert torch.equal(apply_rotary(x[..., :16], cos, sin), _eager_rotary(x[..., :16], cos, sin))


@pytest.mark.parametrize("width", [576, 100, 7])
def test_rms_norm_float32_is_within_float32_rounding_of_float64(width):
    x, weight = _rows(33, width, torch.float32, width)
    got = rms_norm(x, weight, EPS)
    xd = x.double()
    exact = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + EPS) * weight.double()
    # float32 squares summed in 16 lanes then across them (error <= (width/16 + 16) ulps of the sum),
    # the rsqrt and two products (a few ulps each): relative (width/32 + 16) * 2^-24 bounds all of it.
    bound = (width / 32 + 16) * 2 ** -24 * exact.abs() + 1e-30
    assert ((got.double() - exact).abs() <= bound).all()
    assert torch.allclose(got, F.rms_norm(x, (width,), weight, EPS), rtol=(width / 32 + 16) * 2 ** -24, atol=0)


def test_rms_norm_bfloat16_is_within_one_ulp_of_f_rms_norm():
    x, weight = _rows(64, 576, torch.bfloat16, 1)
    got, ref = rms_norm(x, weight, EPS), F.rms_norm(x, (576,), weight, EPS)
    ulp = 2.0 ** (torch.frexp(ref.float().abs()).exponent.float() - 8)  # bfloat16: 8 significant bits
    assert ((got.float() - ref.float()).abs() <= ulp).all()
    assert (got == ref).float().mean() > 0.99


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_adds_exactly_and_norms_the_sum(dtype):
    residual, weight = _rows(17, 576, dtype, 2)
    delta, _ = _rows(17, 576, dtype, 3)
    expected_sum = residual + delta
    normed = add_rms_norm(residual, delta, weight, EPS)
    assert torch.equal(residual, expected_sum)
    assert torch.equal(normed, rms_norm(expected_sum, weight, EPS))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_rows_norm_does_not_depend_on_the_other_rows(dtype):
    x, weight = _rows(64, 576, dtype, 4)
    batch = rms_norm(x, weight, EPS)
    assert all(torch.equal(rms_norm(x[i : i + 1], weight, EPS)[0], batch[i]) for i in (0, 31, 63))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, width", [(1, 1536), (64, 1536), (5, 37)])
def test_silu_and_mul_is_bit_identical_to_the_eager_form_on_a_strided_view(dtype, tokens, width):
    """Width 37: a vector body and a scalar tail; the view's rows are strided (every other half row
    skipped); values from -90 to 90 reach exp's overflow and underflow."""
    wide = (torch.randn(tokens, 4 * width) * 30).clamp(-90, 90).to(dtype)
    gate_up = wide[:, : 2 * width]
    got = silu_and_mul(gate_up)
    assert got.is_contiguous() and got.shape == (tokens, width)
    assert torch.equal(got, F.silu(gate_up[:, :width]) * gate_up[:, width:])


def test_float16_and_three_dimensional_inputs_take_the_eager_forms():
    x, weight = _rows(6, 64, torch.float16, 5)
    assert torch.equal(rms_norm(x, weight, EPS), F.rms_norm(x, (64,), weight, EPS))
    heads, head_weight = _rows(12, 64, torch.float32, 6)
    heads = heads.view(3, 4, 64)  # Qwen3's per-head q/k norm
    assert torch.equal(rms_norm(heads, head_weight, EPS), F.rms_norm(heads, (64,), head_weight, EPS))


def test_without_the_library_every_op_is_its_eager_form(monkeypatch):
    monkeypatch.setattr(fused_ops, "fused_ops_available", lambda: False)
    x, weight = _rows(9, 576, torch.float32, 7)
    delta, _ = _rows(9, 576, torch.float32, 8)
    assert torch.equal(rms_norm(x, weight, EPS), F.rms_norm(x, (576,), weight, EPS))
    residual = x.clone()
    assert torch.equal(add_rms_norm(residual, delta, weight, EPS), F.rms_norm(x + delta, (576,), weight, EPS))
    assert torch.equal(residual, x + delta)
    assert torch.equal(silu_and_mul(x), F.silu(x[:, :288]) * x[:, 288:])


@pytest.mark.parametrize("op, args, message", [
    ("rms_norm", (torch.zeros(2, 8), torch.zeros(7), EPS), "weight must be"),
    ("rotary", (torch.zeros(2, 3, 7), torch.zeros(2, 1, 3), torch.zeros(2, 1, 3)), "D even"),
    ("rotary", (torch.zeros(2, 3, 8), torch.zeros(2, 1, 3), torch.zeros(2, 1, 3)), "cos and sin"),
    ("silu_and_mul", (torch.zeros(2, 7),), "gate_up must be"),
    ("silu_and_mul", (torch.zeros(2, 8, dtype=torch.float16),), "float32 or bfloat16"),
])
def test_the_op_refuses_shapes_it_cannot_take(op, args, message):
    with pytest.raises(RuntimeError, match=message):
        getattr(torch.ops.pagedserve_fused, op)(*args)
