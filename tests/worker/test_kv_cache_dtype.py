"""--kv-cache-dtype below the model's: rounding on write, byte-exact copies, block counts, and every
CPU attention path (the C++ op, the torch backend) against the float32 reference over the stored values."""

from __future__ import annotations

import pytest
import torch

from pagedserve_kernels.reference import paged_attention_ref
from pagedserve.engine.attention import CpuAttentionBackend, TorchAttentionBackend
from pagedserve.engine.config import KVCacheDtype
from pagedserve.engine.kv_cache import (KVCache, KVCacheSpec, as_stored, cache_dtype, num_blocks_for_memory,
                                        to_cache_dtype)
from pagedserve.engine.runner_config import RunnerConfig
from tests.worker.test_cpu_attention import OP, _batch, needs_op

KV_DTYPES = (torch.float32, torch.bfloat16, torch.float8_e5m2)
E5M2_MAX = 57344.0  # (2 - 2^-2) * 2^15, e5m2's largest finite value


def _stored(seed, seqs, block_size, heads, kv_heads, dim, kv_dtype):
    """``_batch``'s float32 batch with its caches in ``kv_dtype``, rounded as a write rounds them."""
    md, q, k, v, k_cache, v_cache = _batch(seed, seqs, block_size, heads, kv_heads, dim)
    return md, q, k, v, to_cache_dtype(k_cache, kv_dtype), to_cache_dtype(v_cache, kv_dtype)


def _reference(q, k_cache, v_cache, md, scale):
    """float32 attention over the stored values, widened exactly."""
    return paged_attention_ref(q, k_cache.float(), v_cache.float(), md.block_tables, md.seq_lens,
                               md.query_start_loc, scale)


def test_auto_is_the_model_dtype_and_the_others_their_torch_dtype():
    assert cache_dtype("auto", torch.float32) is torch.float32
    assert cache_dtype(KVCacheDtype.AUTO, torch.bfloat16) is torch.bfloat16
    assert cache_dtype("bfloat16", torch.float32) is torch.bfloat16
    assert cache_dtype("fp8_e5m2", torch.bfloat16) is torch.float8_e5m2
    with pytest.raises(ValueError, match="fp8_e4m3"):
        RunnerConfig(kv_cache_dtype="fp8_e4m3")


def test_a_torch_without_float8_refuses_fp8_e5m2_by_name(monkeypatch):
    monkeypatch.delattr(torch, "float8_e5m2")
    with pytest.raises(ValueError, match=r"--kv-cache-dtype fp8_e5m2 needs torch.float8_e5m2"):
        cache_dtype("fp8_e5m2", torch.float32)


def test_writes_round_to_nearest_even_and_fp8_saturates():
    # e5m2 keeps 2 significand bits: 1.125 and 1.375 are ties between neighbours 0.25 apart
    x = torch.tensor([1.125, 1.375, 1.2, 3e-5, 60000.0, -1e9, 1e9, float("nan")])
    assert to_cache_dtype(x, torch.float8_e5m2).float()[:7].tolist() == [1.0, 1.5, 1.25, 2 ** -15, E5M2_MAX,
                                                                          -E5M2_MAX, E5M2_MAX]
    assert to_cache_dtype(x, torch.float8_e5m2).float()[7].isnan()
    # bfloat16 keeps 8: 1 + 2^-8 is a tie, rounded to even (1.0); 1 + 3 * 2^-8 to 1 + 2^-6
    y = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8])
    assert to_cache_dtype(y, torch.bfloat16).float().tolist() == [1.0, 1 + 2 ** -6]
    assert as_stored(y, torch.bfloat16).dtype is torch.float32 and as_stored(y, torch.float32) is y


@pytest.mark.parametrize("kv_dtype", KV_DTYPES[1:])
def test_backend_writes_the_rounded_rows_at_their_slots(kv_dtype):
    md, q, k, v, k_cache, v_cache = _stored(2, [(5, 3), (0, 4)], 4, 4, 2, 16, kv_dtype)
    k_cache.zero_(), v_cache.zero_()
    TorchAttentionBackend().write_kv(k, v, k_cache, v_cache, md)
    flat_k, flat_v = k_cache.view(-1, 2, 16), v_cache.view(-1, 2, 16)
    assert torch.equal(flat_k[md.slot_mapping].float(), k.to(kv_dtype).float())
    assert torch.equal(flat_v[md.slot_mapping].float(), v.to(kv_dtype).float())
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool)
    untouched[md.slot_mapping] = False
    assert not flat_k[untouched].float().any()


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_swap_and_block_copies_move_every_byte(kv_dtype):
    spec = KVCacheSpec(2, 3, 16, 4, kv_dtype)
    cache = KVCache(spec, num_blocks=6, num_cpu_blocks=3)
    g = torch.Generator().manual_seed(0)
    for layer in cache.key_caches + cache.value_caches:
        layer.copy_(to_cache_dtype(torch.randn(layer.shape, generator=g) * 100, kv_dtype))
    before = [t.clone() for t in cache.key_caches + cache.value_caches]
    cache.swap_out([(1, 0), (4, 2)])
    cache.copy_blocks([(1, 5)])
    cache.swap_in([(2, 1), (0, 3)])  # block 4's bytes into 1, block 1's into 3
    for was, now in zip(before, cache.key_caches + cache.value_caches):
        assert now.dtype is kv_dtype
        for src, dst in [(4, 1), (1, 3), (1, 5), (0, 0), (2, 2)]:
            assert torch.equal(now[dst].view(torch.uint8), was[src].view(torch.uint8))


def test_fp8_holds_four_times_the_blocks_of_float32_in_the_same_memory():
    """The default model's geometry: 30 layers, 3 KV heads of 64, blocks of 16 tokens:
    K+V of one block are 2 * 30 * 16 * 3 * 64 elements = 737,280 bytes in float32."""
    blocks = {dtype: num_blocks_for_memory(KVCacheSpec(30, 3, 64, 16, dtype), 64 << 20) for dtype in KV_DTYPES}
    assert KVCacheSpec(30, 3, 64, 16, torch.float32).bytes_per_block == 737_280
    assert blocks == {torch.float32: 91, torch.bfloat16: 182, torch.float8_e5m2: 364}


@needs_op
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3), (16, 2)])  # GQA groups 1, 3, 8
@pytest.mark.parametrize("seqs,block_size", [
    ([(9, 1), (30, 1), (0, 1), (17, 1)], 16),                    # decodes (one a one-token prompt)
    ([(5, 1), (40, 1), (0, 12), (16, 16), (13, 9), (3, 1)], 8),  # prefill and decode rows, ragged
    ([(700, 1), (1, 1), (250, 20)], 32),                         # long context, key tiles across blocks
])
def test_op_reads_every_cache_dtype_as_the_float32_reference(kv_dtype, heads, kv_heads, seqs, block_size):
    """All arithmetic is float32 over the stored values, so the float32 tolerance holds for every
    cache dtype; outputs pre-filled with NaN must be overwritten everywhere."""
    md, q, _, _, k_cache, v_cache = _stored(len(seqs), seqs, block_size, heads, kv_heads, 64, kv_dtype)
    out = torch.full_like(q, float("nan"))
    OP(out, q, k_cache, v_cache, md.block_tables, md.seq_lens, md.query_start_loc, 0.125)
    torch.testing.assert_close(out, _reference(q, k_cache, v_cache, md, 0.125), rtol=1e-5, atol=1e-5)


@needs_op
@pytest.mark.parametrize("kv_dtype", KV_DTYPES[1:])
def test_op_with_a_bfloat16_query_reads_a_narrower_cache(kv_dtype):
    md, q, _, _, k_cache, v_cache = _stored(4, [(60, 1), (10, 1), (3, 9)], 16, 9, 3, 64, kv_dtype)
    q = q.bfloat16()
    out = torch.full_like(q, float("nan"))
    OP(out, q, k_cache, v_cache, md.block_tables, md.seq_lens, md.query_start_loc, 0.125)
    want = _reference(q.float(), k_cache, v_cache, md, 0.125)
    torch.testing.assert_close(out.float(), want, rtol=2 ** -8, atol=2 ** -8)  # the output's bf16 rounding


@needs_op
def test_op_refuses_caches_of_two_dtypes_or_an_unread_one():
    md, q, _, _, k_cache, v_cache = _stored(1, [(20, 1)], 8, 4, 2, 16, torch.float32)
    with pytest.raises(RuntimeError, match="must share one dtype"):
        OP(torch.empty_like(q), q, k_cache.bfloat16(), v_cache, md.block_tables, md.seq_lens, md.query_start_loc, 0.25)
    with pytest.raises(RuntimeError, match="the query's, bfloat16 or float8_e5m2"):
        OP(torch.empty_like(q), q, k_cache.half(), v_cache.half(), md.block_tables, md.seq_lens,
           md.query_start_loc, 0.25)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("kv_dtype", KV_DTYPES[1:])
def test_backends_attend_over_the_stored_values(backend, kv_dtype):
    """Decodes, fresh prefills and prefills over cached context all read K/V as stored: a fresh
    prefill's own K/V are rounded too, so the result equals the reference over the cache."""
    if backend == "cpu" and OP is None:
        pytest.skip("the C++ op could not be built here")
    seqs = [(40, 1), (17, 1), (3, 1), (0, 12), (16, 16), (13, 9)]
    md, q, k, v, k_cache, v_cache = _stored(9, seqs, 8, 9, 3, 64, kv_dtype)
    attention = CpuAttentionBackend(OP) if backend == "cpu" else TorchAttentionBackend()
    got = attention.attend(q, k, v, k_cache, v_cache, md, 0.125)
    torch.testing.assert_close(got, _reference(q, k_cache, v_cache, md, 0.125), rtol=1e-5, atol=1e-5)


@needs_op
@pytest.mark.parametrize("kv_dtype,bits", [(torch.float8_e5m2, torch.uint8), (torch.bfloat16, torch.int16)])
def test_op_widens_every_bit_pattern_exactly(kv_dtype, bits):
    """One cached token: softmax weight 1, so the output is V as widened, for every value the dtype has
    (subnormals, infinities and NaNs included), against torch's conversion."""
    from pagedserve.engine.attention import build_attention_metadata, compute_positions

    n = 1 << (8 * kv_dtype.itemsize)
    values = torch.arange(n, dtype=torch.int32).to(bits).view(kv_dtype).view(1, 1, 1, n)  # (NB, BS, Hkv, D)
    md = build_attention_metadata([1], [0], [[0]], compute_positions([1], [0]), 1)
    q = torch.zeros(1, 1, n)
    out = torch.full_like(q, float("nan"))
    OP(out, q, torch.zeros_like(values), values, md.block_tables, md.seq_lens, md.query_start_loc, 1.0)
    torch.testing.assert_close(out.flatten(), values.flatten().float(), rtol=0, atol=0, equal_nan=True)
