"""Sanity checks of the torch references against explicit loops."""

import math

import torch

from pagedserve_kernels.reference import paged_attention_ref, write_kv_cache_ref


def test_write_kv_cache_ref_skips_negative_slots():
    k_cache = torch.zeros(2, 4, 1, 2)
    v_cache = torch.zeros(2, 4, 1, 2)
    key = torch.arange(6.0).view(3, 1, 2)
    value = -key
    write_kv_cache_ref(key, value, k_cache, v_cache, torch.tensor([5, -1, 0]))
    assert torch.equal(k_cache[1, 1, 0], key[0, 0])
    assert torch.equal(k_cache[0, 0, 0], key[2, 0])
    assert torch.equal(v_cache[1, 1, 0], value[0, 0])
    assert int((k_cache != 0).any(-1).sum()) == 2


def test_paged_attention_ref_matches_explicit_loops():
    gen = torch.Generator().manual_seed(0)
    block_size, kv_heads, group, dim = 4, 2, 2, 8
    k_cache = torch.randn(5, block_size, kv_heads, dim, generator=gen)
    v_cache = torch.randn(5, block_size, kv_heads, dim, generator=gen)
    block_tables = torch.tensor([[3, 0, 4], [1, 2, -1]], dtype=torch.int32)
    seq_lens = torch.tensor([10, 6], dtype=torch.int32)
    q_lens = [3, 1]
    qsl = torch.tensor([0, 3, 4], dtype=torch.int32)
    query = torch.randn(4, kv_heads * group, dim, generator=gen)
    scale = 0.3
    out = paged_attention_ref(query, k_cache, v_cache, block_tables, seq_lens, qsl, scale)
    for s in range(2):
        n, ql = int(seq_lens[s]), q_lens[s]
        for t in range(ql):
            pos = n - ql + t
            for h in range(kv_heads * group):
                kvh = h // group
                keys = [k_cache[block_tables[s, j // block_size], j % block_size, kvh]
                        for j in range(pos + 1)]
                vals = [v_cache[block_tables[s, j // block_size], j % block_size, kvh]
                        for j in range(pos + 1)]
                q = query[int(qsl[s]) + t, h]
                w = torch.softmax(torch.stack([q @ k * scale for k in keys]), 0)
                expected = sum(wi * v for wi, v in zip(w, vals))
                assert torch.allclose(out[int(qsl[s]) + t, h], expected, atol=1e-5)
    assert math.isfinite(out.abs().max().item())
