"""Row-wise layer ops fused into one C++ pass each on CPU (``csrc/fused_ops.cpp``): RMSNorm, the
residual add followed by RMSNorm, the rotary embedding and SwiGLU's ``silu(gate) * up``, each falling back to its eager PyTorch form
elsewhere (GPU tensors, float16, inside a ``torch.compile`` trace, whose inductor fuses them itself, or
where the library cannot be built).

The rotary op and ``silu_and_mul`` are bit-identical to the eager forms; the norms round where ``F.rms_norm`` rounds and sum
the squares in another order (within float32 rounding of float64, and within one bfloat16 ulp of
``F.rms_norm``: tests/worker/test_fused_ops.py). Decode steps of the default model, fused against eager in one process
(scripts/fused_ops_step_ab.py; docs/benchmarks.md, "Fused row-wise ops, and one OpenMP team"): 64
sequences 1.02x float32, 1.08x bfloat16; one sequence 1.06x / 1.12x.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
import torch.nn.functional as F

SOURCE = Path(__file__).parent / "csrc" / "fused_ops.cpp"
DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def fused_ops_available() -> bool:
    """Whether the fused ops are built and loaded (on first use, as the attention op)."""
    from pagedserve.engine.attention.cpu_op import load_cpu_library

    return load_cpu_library(SOURCE, "pagedserve_fused_ops", "the fused row-wise ops for CPU (RMSNorm, rotary)",
                            "the eager PyTorch ops")


def _fused(x: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and x.dtype in DTYPES and x.stride(-1) == 1
            and not torch.compiler.is_compiling() and fused_ops_available())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x**2) + eps) * weight`` over the last dimension (Zhang & Sennrich, 2019): ``x``
    ``[..., H]`` -> a new ``[..., H]`` of its dtype; ``weight`` ``[H]`` of the same dtype."""
    if x.dim() == 2 and _fused(x):
        return torch.ops.pagedserve_fused.rms_norm(x, weight, eps)
    return F.rms_norm(x, weight.shape, weight, eps)


def add_rms_norm(residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``residual += delta`` (in place), then :func:`rms_norm` of it: ``[T, H]`` tensors of one dtype
    -> a new ``[T, H]``."""
    if _fused(residual) and delta.stride(-1) == 1:
        return torch.ops.pagedserve_fused.add_rms_norm(residual, delta, weight, eps)
    residual += delta
    return F.rms_norm(residual, weight.shape, weight, eps)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates each head of ``x`` ``[T, n, D]`` by ``cos``/``sin`` ``[T, 1, D/2]`` (rotate-half
    pairing, Su et al., 2021); returns a new contiguous ``[T, n, D]``."""
    if _fused(x) and cos.dtype == x.dtype and cos.is_contiguous() and sin.is_contiguous():
        return torch.ops.pagedserve_fused.rotary(x, cos, sin)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]                                 # (T, n, D/2) each
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)  # (T, n, D)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation (Shazeer, 2020): ``gate_up`` ``[T, 2I]`` (gate columns first) -> a new
    ``[T, I]`` ``silu(gate) * up`` of its dtype."""
    if gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0 and _fused(gate_up):
        return torch.ops.pagedserve_fused.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)                                    # (T, I) each
    return F.silu(gate).mul_(up)
