"""Attention metadata conventions and the torch paged-attention backend against the reference."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve_kernels.reference import paged_attention_ref
from pagedserve.engine.attention import TorchAttentionBackend, build_attention_metadata, compute_positions
from pagedserve.engine.kv_cache import KVCache, KVCacheSpec, context_shortfall, num_blocks_for_memory


def test_metadata_conventions():
    # seq 0 decodes its 6th token, seq 1 prefills 3 fresh tokens, seq 2 computes a 2-token chunk after 4
    query_lens, context_lens = [1, 3, 2], [5, 0, 4]
    tables = [[7, 2], [4], [9, 1, 3]]
    positions = compute_positions(query_lens, context_lens)
    assert positions.tolist() == [5, 0, 1, 2, 4, 5]
    md = build_attention_metadata(query_lens, context_lens, tables, positions, block_size=4)
    assert md.slot_mapping.dtype == torch.int64
    assert md.slot_mapping.tolist() == [2 * 4 + 1, 4 * 4 + 0, 4 * 4 + 1, 4 * 4 + 2, 1 * 4 + 0, 1 * 4 + 1]
    assert md.block_tables.dtype == torch.int32 and md.block_tables.tolist() == [[7, 2], [4, 0], [9, 1]]
    assert md.seq_lens.dtype == torch.int32 and md.seq_lens.tolist() == [6, 3, 6]
    assert md.query_start_loc.dtype == torch.int32 and md.query_start_loc.tolist() == [0, 1, 4, 6]
    assert (md.max_query_len, md.max_seq_len) == (3, 6)
    assert [(c.start, c.end, c.padded_len) for c in md.decode_chunks] == [(0, 1, 8)]
    assert [(p.query_start, p.query_end) for p in md.fresh_prefills] == [(1, 4)]
    assert [(p.query_start, p.query_end) for p in md.context_prefills] == [(4, 6)]


def test_decode_chunks_bound_the_gathered_positions():
    lens = [40, 33, 20, 17, 9, 1]  # context before the new token, longest first
    positions = compute_positions([1] * 6, lens)
    md = build_attention_metadata([1] * 6, lens, [list(range(i * 12, i * 12 + 12)) for i in range(6)], positions,
                                  block_size=4, decode_chunk_tokens=96)
    assert [(c.start, c.end, c.padded_len) for c in md.decode_chunks] == [(0, 2, 44), (2, 6, 24)]
    first = md.decode_chunks[0]
    assert first.mask.shape == (2, 1, 1, 44)
    # 11 whole blocks each; the second sequence needs 9, then its table padding (block 0), masked
    assert first.block_indices.tolist() == list(range(0, 11)) + list(range(12, 21)) + [0, 0]
    assert bool((first.mask[1, 0, 0, :34] == 0).all()) and bool(torch.isinf(first.mask[1, 0, 0, 34:]).all())


def test_the_torch_backends_helpers_are_built_once_when_it_first_reads_them():
    """The C++ and Triton backends read only the kernel inputs; the torch backend's gather chunks and masks
    (3.5 ms of a 256-decode step's metadata) are built at its first read and shared by every layer."""
    lens = [40, 33, 20]
    md = build_attention_metadata([1, 1, 5], lens, [list(range(i * 12, i * 12 + 12)) for i in range(3)],
                                  compute_positions([1, 1, 5], lens), block_size=4)
    assert not {"decode_chunks", "_prefills"} & set(vars(md))
    chunks = md.decode_chunks
    assert md.decode_chunks is chunks and [(c.start, c.end) for c in chunks] == [(0, 2)]
    assert [(p.query_start, p.query_end, p.context_len) for p in md.context_prefills] == [(2, 7, 20)]
    assert md.fresh_prefills == () and "_prefills" in vars(md)


def test_metadata_rejects_short_block_table():
    positions = compute_positions([5], [0])
    with pytest.raises(ValueError, match="needs 2 blocks"):
        build_attention_metadata([5], [0], [[3]], positions, block_size=4)


def _random_batch(seed: int, seqs: list[tuple[int, int]], block_size: int, num_blocks: int):
    """Random cache, block tables and new q/k/v for ``(context_len, query_len)`` sequences."""
    g = torch.Generator().manual_seed(seed)
    heads, kv_heads, dim = 6, 2, 16
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=g)
    free = list(range(num_blocks))
    random.Random(seed).shuffle(free)
    tables = [[free.pop() for _ in range(-(-(c + q) // block_size) + 1)] for c, q in seqs]  # one spare block
    num_tokens = sum(q for _, q in seqs)
    q = torch.randn(num_tokens, heads, dim, generator=g)
    k = torch.randn(num_tokens, kv_heads, dim, generator=g)
    v = torch.randn(num_tokens, kv_heads, dim, generator=g)
    return k_cache, v_cache, tables, q, k, v


@pytest.mark.parametrize("seqs", [
    [(9, 1), (30, 1), (0, 1), (17, 1)],                 # decode only (one a single-token prompt)
    [(0, 7), (0, 16), (0, 1)],                           # fresh prefills
    [(5, 1), (40, 1), (0, 12), (16, 16), (13, 9), (3, 1)],  # mixed; the last decode is not in the leading run
])
@pytest.mark.parametrize("chunk_tokens", [4096, 40])
def test_torch_backend_matches_reference(seqs, chunk_tokens):
    block_size = 8
    k_cache, v_cache, tables, q, k, v = _random_batch(len(seqs), seqs, block_size, num_blocks=64)
    query_lens, context_lens = [n for _, n in seqs], [c for c, _ in seqs]
    md = build_attention_metadata(query_lens, context_lens, tables, compute_positions(query_lens, context_lens),
                                  block_size, decode_chunk_tokens=chunk_tokens)
    backend = TorchAttentionBackend()
    backend.write_kv(k, v, k_cache, v_cache, md)
    flat_k = k_cache.view(-1, 2, 16)
    assert torch.equal(flat_k[md.slot_mapping], k)
    scale = 16 ** -0.5
    got = backend.attend(q, k, v, k_cache, v_cache, md, scale)
    want = paged_attention_ref(q, k_cache, v_cache, md.block_tables, md.seq_lens, md.query_start_loc, scale)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    again = backend.attend(q, k, v, k_cache, v_cache, md, scale)  # reused gather buffers give the same answer
    torch.testing.assert_close(again, got, rtol=0, atol=0)


@settings(max_examples=25, deadline=None)
@given(seqs=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 12)), min_size=1, max_size=6),
       block_size=st.sampled_from([1, 2, 4, 16]), chunk_tokens=st.integers(1, 128),
       decodes_first=st.booleans())
def test_any_ragged_batch_matches_reference(seqs, block_size, chunk_tokens, decodes_first):
    if decodes_first:
        seqs = sorted(seqs, key=lambda s: s[1] != 1)
    k_cache, v_cache, tables, q, k, v = _random_batch(7, seqs, block_size, num_blocks=400)
    query_lens, context_lens = [n for _, n in seqs], [c for c, _ in seqs]
    md = build_attention_metadata(query_lens, context_lens, tables, compute_positions(query_lens, context_lens),
                                  block_size, decode_chunk_tokens=chunk_tokens)
    backend = TorchAttentionBackend()
    backend.write_kv(k, v, k_cache, v_cache, md)
    got = backend.attend(q, k, v, k_cache, v_cache, md, 0.25)
    want = paged_attention_ref(q, k_cache, v_cache, md.block_tables, md.seq_lens, md.query_start_loc, 0.25)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_kv_cache_sizing():
    spec = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float32)
    assert spec.bytes_per_block == 2 * 3 * 4 * 2 * 8 * 4
    assert num_blocks_for_memory(spec, 10 * spec.bytes_per_block + 5) == 10
    with pytest.raises(ValueError, match="holds no block"):
        num_blocks_for_memory(spec, spec.bytes_per_block - 1)
    cache = KVCache(spec, 10)
    key, value = cache.layer(2)
    assert key.shape == value.shape == (10, 4, 2, 8) and cache.block_size == 4
    assert len(cache.key_caches) == 3 and float(key.abs().sum()) == 0.0


def test_a_cache_short_of_one_context_is_named_with_the_memory_that_holds_one():
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=16, block_size=16, dtype=torch.float32)  # 8 KiB a block
    draft = KVCacheSpec(num_layers=1, num_kv_heads=2, head_dim=16, block_size=16, dtype=torch.float32)  # 4 KiB
    assert context_shortfall(spec, 512, 8192) is None  # 512 blocks of 16: exactly one context
    assert context_shortfall(spec, 511, 8192) == (
        "the KV cache holds 8176 tokens (511 blocks of 16), fewer than the model's context of 8192: a request that "
        "grows past 8176 tokens ends with finish_reason 'length'; give --kv-cache-memory 4MiB or more to hold a "
        "whole context")
    assert "--kv-cache-memory 6MiB or more" in context_shortfall(spec, 64, 8192, draft)  # the draft's blocks too
    assert "--kv-cache-memory 1MiB or more" in context_shortfall(spec, 1, 100)  # 7 blocks: 56 KiB, rounded up
    assert "--kv-cache-memory 8MiB or more" in context_shortfall(spec, 64, 8192, num_caches=2)  # 2 virtual engines
