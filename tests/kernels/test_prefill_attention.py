"""paged_prefill_attention (Triton) against paged_attention_ref."""

import pytest
import torch

from kernel_test_utils import DEVICE, assert_close, make_paged_kv, nan_like, randn, requires_cuda
from pagedserve_kernels.prefill_attention import paged_prefill_attention
from pagedserve_kernels.reference import paged_attention_ref

# (cached prefix length, new query length) per sequence: a fresh prefill, a
# decode-like single token, and extends whose lengths are not block multiples.
BATCH = [(0, 19), (30, 1), (13, 7), (45, 33)]
NUM_KV_HEADS = 2


def _run_case(block_size, group, head_dim, dtype, batch=BATCH, seed=0):
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [ctx + q for ctx, q in batch]
    q_lens = [q for _, q in batch]
    k_cache, v_cache, block_tables = make_paged_kv(seq_lens, block_size, NUM_KV_HEADS,
                                                   head_dim, dtype, gen)
    query = randn(sum(q_lens), NUM_KV_HEADS * group, head_dim, dtype=dtype, gen=gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    qsl = torch.tensor([0] + q_lens, dtype=torch.int32, device=DEVICE).cumsum(0).to(torch.int32)
    scale = head_dim ** -0.5
    out = nan_like(query)
    result = paged_prefill_attention(query, k_cache, v_cache, block_tables, lens, qsl, scale,
                                     max_query_len=max(q_lens), out=out)
    assert result is out
    ref = paged_attention_ref(query.float(), k_cache.float(), v_cache.float(), block_tables,
                              lens, qsl, scale)
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("block_size,group,head_dim,dtype", [
    (16, 1, 64, torch.float32),
    (8, 3, 64, torch.float32),
    (32, 8, 64, torch.float32),
    (16, 3, 128, torch.float32),
    (8, 1, 64, torch.float16),
    (16, 8, 64, torch.float16),
    (32, 3, 64, torch.float16),
])
def test_prefill_matches_reference(block_size, group, head_dim, dtype):
    _run_case(block_size, group, head_dim, dtype)


def test_prefill_multiple_query_tiles():
    """Query lengths > 64 span several query tiles and causal diagonal tiles.

    (62, 3) puts the first query at position 62: key tile [0, 64) straddles it,
    so it must take the masked path.
    """
    _run_case(16, 1, 64, torch.float32, batch=[(5, 70), (0, 1), (100, 66), (62, 3)])


def test_prefill_all_decode():
    """query_len 1 everywhere: prefill kernel must equal decode attention."""
    _run_case(8, 3, 64, torch.float16, batch=[(0, 1), (9, 1), (63, 1)])


def test_prefill_strided_query_and_out():
    gen = torch.Generator().manual_seed(5)
    k_cache, v_cache, block_tables = make_paged_kv([12, 20], 8, 2, 64, torch.float32, gen)
    query = randn(9, 4, 128, dtype=torch.float32, gen=gen)[:, :, 64:]
    out = torch.full((9, 4, 192), float("nan"), device=DEVICE)[:, :, :64]
    lens = torch.tensor([12, 20], dtype=torch.int64, device=DEVICE)
    qsl = torch.tensor([0, 4, 9], dtype=torch.int64, device=DEVICE)
    paged_prefill_attention(query, k_cache, v_cache, block_tables, lens, qsl, 0.1, 5, out=out)
    ref = paged_attention_ref(query, k_cache, v_cache, block_tables, lens, qsl, 0.1)
    assert_close(out, ref, torch.float32)


@requires_cuda
def test_prefill_bfloat16_cuda():
    _run_case(16, 4, 128, torch.bfloat16, batch=[(0, 150), (30, 1), (200, 77)])


def _inputs(q_dtype=torch.float32, cache_dtype=torch.float32, num_heads=4,
            qsl_dtype=torch.int32, num_seqs_qsl=2):
    k_cache = torch.zeros(4, 8, 2, 64, dtype=cache_dtype, device=DEVICE)
    query = torch.zeros(3, num_heads, 64, dtype=q_dtype, device=DEVICE)
    block_tables = torch.zeros(2, 2, dtype=torch.int32, device=DEVICE)
    seq_lens = torch.tensor([1, 2], dtype=torch.int32, device=DEVICE)
    qsl = torch.tensor([0, 1, 3][:num_seqs_qsl + 1], device=DEVICE).to(qsl_dtype)
    return query, k_cache, k_cache.clone(), block_tables, seq_lens, qsl, 0.125, 2


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(cache_dtype=torch.float16), TypeError, "k_cache dtype"),  # bfloat16 is read (widened)
    (dict(qsl_dtype=torch.float32), TypeError, "query_start_loc"),
    (dict(num_heads=3), ValueError, "not a multiple of k_cache num_kv_heads"),
    (dict(num_seqs_qsl=1), ValueError, "query_start_loc has shape"),
])
def test_prefill_validation(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        paged_prefill_attention(*_inputs(**kwargs))


def test_prefill_validation_max_query_len_and_v_cache():
    query, k_cache, v_cache, bt, lens, qsl, scale, _ = _inputs()
    with pytest.raises(ValueError, match="max_query_len"):
        paged_prefill_attention(query, k_cache, v_cache, bt, lens, qsl, scale, -1)
    with pytest.raises(TypeError, match="v_cache dtype"):
        paged_prefill_attention(query, k_cache, v_cache.half(), bt, lens, qsl, scale, 2)
