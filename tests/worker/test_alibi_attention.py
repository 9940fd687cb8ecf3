"""ALiBi (Press et al., 2022, §3) in the attention backends against a dense masked-softmax reference:
ragged batches with shuffled block tables, GQA, context lengths not a multiple of the block size."""

from __future__ import annotations

import math
import random

import pytest
import torch

from pagedserve_kernels.reference import paged_attention_ref
from pagedserve.engine.attention import (CpuAttentionBackend, TorchAttentionBackend, build_attention_metadata,
                                         compute_positions, cpu_op)
from pagedserve.engine.attention.alibi import alibi_slopes

BATCHES = {
    "decodes": ([(9, 1), (30, 1), (0, 1), (17, 1)], 16),
    "fresh_prefills": ([(0, 7), (0, 33), (5, 1)], 4),
    "mixed": ([(5, 1), (40, 1), (0, 12), (16, 16), (13, 9), (3, 1)], 8),
    "long": ([(300, 1), (1, 1), (120, 20)], 32),
}


def make_batch(seed: int, seqs: list[tuple[int, int]], block_size: int, heads: int, kv_heads: int, dim: int,
               dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """A random cache, shuffled block tables (one spare block each) and new q/k/v written to the cache
    for ``(context_len, query_len)`` sequences, on ``device`` (drawn on the CPU: the same values anywhere)."""
    g = torch.Generator().manual_seed(seed)
    need = sum(-(-(c + q) // block_size) + 1 for c, q in seqs) + 3
    k_cache = torch.randn(need, block_size, kv_heads, dim, generator=g).to(dtype)
    v_cache = torch.randn(need, block_size, kv_heads, dim, generator=g).to(dtype)
    free = list(range(need))
    random.Random(seed).shuffle(free)
    tables = [[free.pop() for _ in range(-(-(c + q) // block_size) + 1)] for c, q in seqs]
    query_lens, context_lens = [q for _, q in seqs], [c for c, _ in seqs]
    md = build_attention_metadata(query_lens, context_lens, tables, compute_positions(query_lens, context_lens),
                                  block_size, dtype=dtype, device=device, decode_chunk_tokens=64)
    num_tokens = sum(query_lens)
    q, k, v = (torch.randn(num_tokens, h, dim, generator=g).to(dtype).to(device) for h in (heads, kv_heads, kv_heads))
    k_cache, v_cache = k_cache.to(device), v_cache.to(device)
    TorchAttentionBackend().write_kv(k, v, k_cache, v_cache, md)
    return md, q, k, v, k_cache, v_cache


def dense_reference(md, q, k_cache, v_cache, slopes: torch.Tensor, bf16: bool = False) -> torch.Tensor:
    """Masked softmax with the bias, one sequence at a time (``pagedserve_kernels/reference.py``); ``bf16``:
    transformers' Falcon form ``scale * bf16(slope * bf16(key_pos))``."""
    return paged_attention_ref(q, k_cache, v_cache, md.block_tables, md.seq_lens, md.query_start_loc,
                               q.shape[-1] ** -0.5, alibi_slopes=slopes, alibi_bf16=bf16)


def test_slopes_match_the_paper_and_transformers():
    """Powers of two: ``2^(-8i/n)``; otherwise transformers' ``build_alibi_tensor`` (interleaved from 2c)."""
    from transformers.models.falcon.modeling_falcon import build_alibi_tensor

    assert alibi_slopes(8).tolist() == [2.0 ** -i for i in range(1, 9)]
    assert torch.allclose(alibi_slopes(16), torch.tensor([2 ** (-0.5 * i) for i in range(1, 17)]))
    for n in (1, 2, 3, 4, 6, 12, 20, 32, 71):
        hf = build_alibi_tensor(torch.tensor([[1, 1]]), n, torch.float32).view(n, 2)[:, 1]  # slope * 1 (bf16)
        assert torch.equal(alibi_slopes(n).bfloat16().float(), hf), n
        assert alibi_slopes(n).shape == (n,) and bool((alibi_slopes(n) > 0).all())
    assert math.isclose(float(alibi_slopes(12)[8]), 2 ** -0.5, rel_tol=1e-6)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (8, 1)])
@pytest.mark.parametrize("batch", sorted(BATCHES))
def test_torch_backend_alibi(batch, heads, kv_heads):
    seqs, block_size = BATCHES[batch]
    md, q, k, v, k_cache, v_cache = make_batch(1, seqs, block_size, heads, kv_heads, 16)
    slopes = alibi_slopes(heads) * 4  # steep, so a wrong offset shows
    got = TorchAttentionBackend().attend(q, k, v, k_cache, v_cache, md, 16 ** -0.5, alibi_slopes=slopes)
    want = dense_reference(md, q, k_cache, v_cache, slopes)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    plain = TorchAttentionBackend().attend(q, k, v, k_cache, v_cache, md, 16 ** -0.5)
    assert not torch.allclose(plain, got, atol=1e-3), "the bias changes the output"
    torch.testing.assert_close(plain, dense_reference(md, q, k_cache, v_cache, torch.zeros(heads)),
                               rtol=1e-5, atol=1e-5)


def test_torch_backend_alibi_bfloat16():
    md, q, k, v, k_cache, v_cache = make_batch(2, BATCHES["mixed"][0], 8, 6, 2, 16, torch.bfloat16)
    slopes = alibi_slopes(6)
    got = TorchAttentionBackend().attend(q, k, v, k_cache, v_cache, md, 0.25, alibi_slopes=slopes)
    assert got.dtype == torch.bfloat16
    want = dense_reference(md, q, k_cache, v_cache, slopes)
    torch.testing.assert_close(got.float(), want.float(), rtol=3e-2, atol=3e-2)


OP = cpu_op.load_cpu_attention_op()
needs_op = pytest.mark.skipif(OP is None, reason="the C++ op could not be built here (see the warning)")


@needs_op
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (8, 1)])
@pytest.mark.parametrize("batch", sorted(BATCHES))
def test_cpu_op_alibi(batch, heads, kv_heads):
    """The op on the whole batch (its prefill tiles too), and the cpu backend (op for decodes)."""
    seqs, block_size = BATCHES[batch]
    md, q, k, v, k_cache, v_cache = make_batch(3, seqs, block_size, heads, kv_heads, 32)
    slopes = alibi_slopes(heads) * 4
    want = dense_reference(md, q, k_cache, v_cache, slopes)
    out = torch.empty_like(q)
    OP(out, q, k_cache, v_cache, md.block_tables, md.seq_lens, md.query_start_loc, 32 ** -0.5, slopes)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    got = CpuAttentionBackend(OP).attend(q, k, v, k_cache, v_cache, md, 32 ** -0.5, alibi_slopes=slopes)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    OP(out, q, k_cache, v_cache, md.block_tables, md.seq_lens, md.query_start_loc, 32 ** -0.5)  # no bias
    torch.testing.assert_close(out, dense_reference(md, q, k_cache, v_cache, torch.zeros(heads)),
                               rtol=1e-5, atol=1e-5)


@needs_op
def test_cpu_op_alibi_bfloat16_and_bad_slopes():
    md, q, k, v, k_cache, v_cache = make_batch(4, BATCHES["mixed"][0], 8, 6, 2, 16, torch.bfloat16)
    slopes = alibi_slopes(6)
    got = CpuAttentionBackend(OP).attend(q, k, v, k_cache, v_cache, md, 0.25, alibi_slopes=slopes)
    want = dense_reference(md, q, k_cache, v_cache, slopes)
    torch.testing.assert_close(got.float(), want.float(), rtol=3e-2, atol=3e-2)
    out = torch.empty_like(q)
    for bad in (alibi_slopes(4), slopes.double(), slopes.bfloat16()):
        with pytest.raises(RuntimeError, match="alibi_slopes must be"):
            OP(out, q, k_cache, v_cache, md.block_tables, md.seq_lens, md.query_start_loc, 0.25, bad)


@pytest.mark.parametrize("batch", sorted(BATCHES))
def test_falcon_bf16_form(batch):
    """``alibi_bf16``: ``scale * bf16(slope * bf16(key_pos))`` (transformers' Falcon) in the torch backend,
    the op (whole batch) and the cpu backend; 12 heads, so some slopes are not powers of two."""
    seqs, block_size = BATCHES[batch]
    md, q, k, v, k_cache, v_cache = make_batch(9, seqs, block_size, 12, 4, 16)
    slopes, scale = alibi_slopes(12).bfloat16().float() * 8, 0.25
    want = dense_reference(md, q, k_cache, v_cache, slopes, bf16=True)
    got = TorchAttentionBackend().attend(q, k, v, k_cache, v_cache, md, scale, alibi_slopes=slopes, alibi_bf16=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if batch == "long":  # the rounding is visible: not the relative float32 bias scaled
        relative = dense_reference(md, q, k_cache, v_cache, slopes * scale)
        assert (want - relative).abs().max() > 1e-3
    if OP is None:
        return
    out = torch.empty_like(q)
    OP(out, q, k_cache, v_cache, md.block_tables, md.seq_lens, md.query_start_loc, scale, slopes, True)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    got = CpuAttentionBackend(OP).attend(q, k, v, k_cache, v_cache, md, scale, alibi_slopes=slopes, alibi_bf16=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
