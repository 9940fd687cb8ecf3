"""Shared helpers for the kernel tests: random paged caches and error metrics."""

from __future__ import annotations

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max|out - ref| / max|ref| (NaN if ``out`` has an unwritten NaN element)."""
    out, ref = out.float().cpu(), ref.float().cpu()
    return ((out - ref).abs().max() / ref.abs().max()).item()


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert torch.isfinite(out).all(), "output has unwritten (NaN) or non-finite elements"
    err = rel_err(out, ref)
    assert err < TOLERANCE[dtype], f"relative error {err:.3g} >= {TOLERANCE[dtype]:.0e} ({dtype})"


def make_paged_kv(seq_lens: list[int], block_size: int, num_kv_heads: int, head_dim: int,
                  dtype: torch.dtype, gen: torch.Generator, spare_blocks: int = 3):
    """Random caches holding ``seq_lens[i]`` tokens per sequence in shuffled blocks.

    Physical blocks are a random permutation (so block tables are
    non-contiguous); cache slots not holding a token (spare blocks, the tail of
    each last block) are NaN, and block-table padding is -1, so a kernel that
    reads outside a sequence's context produces NaN.

    Returns ``(k_cache, v_cache, block_tables int32 [num_seqs, max_blocks + 1])``.
    """
    per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(per_seq) + spare_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    block_tables = torch.full((len(seq_lens), max(per_seq, default=0) + 1), -1, dtype=torch.int32)
    perm = torch.randperm(num_blocks, generator=gen)
    cursor = 0
    for i, (n, nb) in enumerate(zip(seq_lens, per_seq)):
        ids = perm[cursor:cursor + nb]
        cursor += nb
        block_tables[i, :nb] = ids.to(torch.int32)
        for cache in (k_cache, v_cache):
            data = torch.randn(nb * block_size, num_kv_heads, head_dim, generator=gen)
            data[n:] = float("nan")
            cache[ids] = data.view(nb, block_size, num_kv_heads, head_dim).to(dtype)
    return k_cache.to(DEVICE), v_cache.to(DEVICE), block_tables.to(DEVICE)


def randn(*shape, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)


def nan_like(t: torch.Tensor) -> torch.Tensor:
    return torch.full_like(t, float("nan"))


requires_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs CUDA: the Triton interpreter computes bfloat16 tl.dot incorrectly")
