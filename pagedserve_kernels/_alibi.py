"""ALiBi helper shared by the attention kernels (Press et al., ICLR 2022, §3)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_bf16(x):
    """float32 -> nearest bfloat16 (ties to even), as float32, for finite non-negative ``x``:
    transformers' Falcon rounds ``slope * key_pos`` so. Done on the bits, so the interpreter (whose
    casts may truncate) and the GPU agree."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)
