"""paged_decode_attention (Triton) against paged_attention_ref."""

import pytest
import torch

from kernel_test_utils import DEVICE, assert_close, make_paged_kv, nan_like, randn, requires_cuda
from pagedserve_kernels.decode_attention import choose_num_splits, paged_decode_attention
from pagedserve_kernels.reference import paged_decode_attention_ref

SEQ_LENS = [1, 17, 50, 130]  # ragged, mostly not multiples of the block size
NUM_KV_HEADS = 2


def _run_case(block_size, group, head_dim, dtype, num_splits, seq_lens=SEQ_LENS, seed=0):
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, block_tables = make_paged_kv(seq_lens, block_size, NUM_KV_HEADS,
                                                   head_dim, dtype, gen)
    query = randn(len(seq_lens), NUM_KV_HEADS * group, head_dim, dtype=dtype, gen=gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    scale = head_dim ** -0.5
    out = nan_like(query)
    result = paged_decode_attention(query, k_cache, v_cache, block_tables, lens, scale,
                                    num_splits=num_splits, out=out)
    assert result is out
    ref = paged_decode_attention_ref(query.float(), k_cache.float(), v_cache.float(),
                                     block_tables, lens, scale)
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
def test_decode_matches_reference(block_size, group, head_dim, dtype):
    _run_case(block_size, group, head_dim, dtype, num_splits=None)


@pytest.mark.parametrize("block_size,group,dtype,num_splits", [
    (16, 3, torch.float32, 2),
    (8, 8, torch.float16, 3),
    (32, 1, torch.float32, 9),  # more splits than key tiles: some splits are empty
])
def test_decode_flash_decoding_splits(block_size, group, dtype, num_splits):
    _run_case(block_size, group, 64, dtype, num_splits=num_splits)


def test_decode_strided_query_and_out():
    gen = torch.Generator().manual_seed(3)
    seq_lens, head_dim = [9, 40], 64
    k_cache, v_cache, block_tables = make_paged_kv(seq_lens, 8, 2, head_dim, torch.float32, gen)
    query = randn(2, 6, 2 * head_dim, dtype=torch.float32, gen=gen)[:, :, :head_dim]
    out = torch.full((2, 6, 3 * head_dim), float("nan"), device=DEVICE)[:, :, head_dim:2 * head_dim]
    lens = torch.tensor(seq_lens, dtype=torch.int64, device=DEVICE)
    paged_decode_attention(query, k_cache, v_cache, block_tables.long(), lens, 0.125, out=out)
    ref = paged_decode_attention_ref(query, k_cache, v_cache, block_tables, lens, 0.125)
    assert_close(out, ref, torch.float32)


def test_choose_num_splits():
    assert choose_num_splits(64, 8, 2048, 132) == 1       # enough programs already
    assert choose_num_splits(1, 8, 32768, 132) == 33      # few long sequences: split
    assert choose_num_splits(1, 8, 300, 132) == 1         # too short to split
    assert choose_num_splits(2, 1, 1024, 132) == 4        # capped at 256 keys per split


@requires_cuda
def test_decode_bfloat16_cuda():
    _run_case(16, 4, 128, torch.bfloat16, num_splits=None, seq_lens=[1, 100, 700])
    _run_case(16, 4, 128, torch.bfloat16, num_splits=4, seq_lens=[1, 100, 700])


def _inputs(q_dtype=torch.float32, cache_dtype=torch.float32, num_heads=4, bt_dtype=torch.int32):
    k_cache = torch.zeros(4, 8, 2, 64, dtype=cache_dtype, device=DEVICE)
    query = torch.zeros(2, num_heads, 64, dtype=q_dtype, device=DEVICE)
    block_tables = torch.zeros(2, 2, dtype=bt_dtype, device=DEVICE)
    seq_lens = torch.ones(2, dtype=torch.int32, device=DEVICE)
    return query, k_cache, k_cache.clone(), block_tables, seq_lens, 0.125


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(cache_dtype=torch.float16), TypeError, "k_cache dtype"),
    (dict(bt_dtype=torch.float32), TypeError, "block_tables"),
    (dict(num_heads=5), ValueError, "not a multiple of k_cache num_kv_heads"),
])
def test_decode_validation(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        paged_decode_attention(*_inputs(**kwargs))


def test_decode_validation_shapes_and_devices(monkeypatch):
    query, k_cache, v_cache, block_tables, seq_lens, scale = _inputs()
    with pytest.raises(ValueError, match="head_dim"):
        paged_decode_attention(query[:, :, :48], k_cache[..., :48], v_cache[..., :48],
                               block_tables, seq_lens, scale)
    with pytest.raises(ValueError, match="seq_lens"):
        paged_decode_attention(query, k_cache, v_cache, block_tables, seq_lens[:1], scale)
    with pytest.raises(ValueError, match="out has shape"):
        paged_decode_attention(query, k_cache, v_cache, block_tables, seq_lens, scale,
                               out=query[:1])
    with pytest.raises(ValueError, match="num_splits"):
        paged_decode_attention(query, k_cache, v_cache, block_tables, seq_lens, scale,
                               num_splits=0)
    with pytest.raises(ValueError, match="same device"):
        paged_decode_attention(query, k_cache, v_cache, block_tables.to("meta"), seq_lens, scale)
    if DEVICE == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(ValueError, match="TRITON_INTERPRET"):
            paged_decode_attention(query, k_cache, v_cache, block_tables, seq_lens, scale)
