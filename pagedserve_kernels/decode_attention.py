"""Paged decode attention (one new query token per sequence) in Triton.

Algorithm:
  * Paged KV: keys/values are read through each sequence's block table
    (PagedAttention, Kwon et al., SOSP 2023, §4.1).
  * Online softmax over key tiles with a running (max, sum, acc) triple
    (FlashAttention-2, Dao 2023, §3.1), in base 2 with the scale folded in.
  * Flash-Decoding (Dao, Haziza, Massa, Sizov, "Flash-Decoding for long-context
    inference", 2023 blog): when there are too few (sequence, KV head) pairs to
    fill the GPU, the context is split into ``num_splits`` chunks processed by
    separate programs, each writing an unnormalised partial (max, sum, acc);
    a second small kernel merges them with log-sum-exp rescaling.
  * GQA: one program handles all ``group`` query heads that share a KV head,
    so each K/V tile is loaded once; the heads form the M dimension of the
    ``tl.dot`` (padded to 16 rows, the minimum MMA size).
  * ALiBi (Press et al., ICLR 2022, §3), when slopes are given (``ALIBI``):
    ``-slope[h] * (query_pos - key_pos)`` added to each scaled score (in base 2);
    with ``ALIBI_BF16`` transformers' Falcon form ``scale * bf16(slope[h] * bf16(key_pos))``.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from pagedserve_kernels._alibi import round_bf16
from pagedserve_kernels._checks import (FLOAT_DTYPES, INDEX_DTYPES, check_alibi_slopes, check_heads, check_kv_cache, check_out,
                             check_same_device, check_cache_dtype, check_shape, check_tensor,
                             next_pow2)

LOG2E = 1.4426950408889634
BLOCK_N = 64            # keys per inner-loop tile
MIN_TOKENS_PER_SPLIT = 256


# Integer arguments that vary from step to step are not specialized (Triton compiles a variant for 1
# and for multiples of 16): the block-table width grows with the longest context, the splits with the batch.
@triton.jit(do_not_specialize=["stride_bt_s", "num_splits"])
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, seq_lens_ptr, slopes_ptr,
    out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
    stride_q_s, stride_q_h, stride_o_s, stride_o_h,
    stride_kc_b, stride_kc_s, stride_kc_h, stride_vc_b, stride_vc_s, stride_vc_h,
    stride_bt_s, stride_bt_b,
    qk_scale, num_heads, num_splits,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, ALIBI: tl.constexpr,
    ALIBI_BF16: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    # This split's key range [start, end), in whole BLOCK_N tiles.
    chunk = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, seq_len)

    offs_g = tl.arange(0, BLOCK_G)                                      # (G,)
    offs_d = tl.arange(0, HEAD_DIM)                                     # (D,)
    head = kv_head * GROUP + offs_g                                     # (G,)
    mask_g = offs_g < GROUP                                             # (G,)
    q = tl.load(q_ptr + seq * stride_q_s + head[:, None] * stride_q_h + offs_d[None, :],
                mask=mask_g[:, None], other=0.0)                        # (G, D)
    if k_cache_ptr.dtype.element_ty != q_ptr.dtype.element_ty:  # a narrower cache: widened per tile, float32
        q = q.to(tl.float32)
    slope = tl.zeros([BLOCK_G], tl.float32)                             # (G,)
    if ALIBI:
        slope = tl.load(slopes_ptr + head, mask=mask_g, other=0.0)     # (G,)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)                 # (G,)
    l_i = tl.zeros([BLOCK_G], tl.float32)                               # (G,)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)                     # (G, D)
    for tile in range(start, end, BLOCK_N):
        offs_n = tile + tl.arange(0, BLOCK_N)                           # (N,)
        mask_n = offs_n < end                                           # (N,)
        block = tl.load(bt_ptr + seq * stride_bt_s + (offs_n // BLOCK_SIZE) * stride_bt_b,
                        mask=mask_n, other=0).to(tl.int64)              # (N,)
        slot_in_block = offs_n % BLOCK_SIZE                             # (N,)
        k_row = block * stride_kc_b + slot_in_block * stride_kc_s + kv_head * stride_kc_h
        v_row = block * stride_vc_b + slot_in_block * stride_vc_s + kv_head * stride_vc_h
        k = tl.load(k_cache_ptr + k_row[None, :] + offs_d[:, None],
                    mask=mask_n[None, :], other=0.0).to(q.dtype)        # (D, N)
        v = tl.load(v_cache_ptr + v_row[:, None] + offs_d[None, :],
                    mask=mask_n[:, None], other=0.0).to(q.dtype)        # (N, D)
        qk = tl.dot(q, k, input_precision="ieee") * qk_scale            # (G, N)
        if ALIBI_BF16:  # qk_scale * bf16(slope * bf16(key_pos)): scaled, in log2 units
            bias = slope[:, None] * round_bf16(offs_n.to(tl.float32))[None, :]  # (G, N)
            qk += round_bf16(bias) * qk_scale                           # (G, N)
        elif ALIBI:  # the scores are in log2 units
            qk += (slope * 1.4426950408889634)[:, None] * (offs_n - (seq_len - 1)).to(tl.float32)[None, :]  # (G, N)
        qk = tl.where(mask_n[None, :], qk, float("-inf"))               # (G, N)
        m_new = tl.maximum(m_i, tl.max(qk, 1))                          # (G,)
        alpha = tl.exp2(m_i - m_new)                                    # (G,)
        p = tl.exp2(qk - m_new[:, None])                                # (G, N)
        l_i = l_i * alpha + tl.sum(p, 1)                                # (G,)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")  # (G, D)
        m_i = m_new

    if SPLIT:
        part = (seq * num_heads + head) * num_splits + split            # (G,)
        tl.store(part_m_ptr + part, m_i, mask=mask_g)
        tl.store(part_l_ptr + part, l_i, mask=mask_g)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc,
                 mask=mask_g[:, None])
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]               # (G, D)
        tl.store(out_ptr + seq * stride_o_s + head[:, None] * stride_o_h + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=mask_g[:, None])


@triton.jit
def _merge_kernel(
    out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
    stride_o_s, stride_o_h, num_heads, num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """Log-sum-exp merge of the per-split partials of one (sequence, head)."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)                                      # (S,)
    offs_d = tl.arange(0, HEAD_DIM)                                     # (D,)
    mask_s = offs_s < num_splits                                        # (S,)
    part = (seq * num_heads + head) * num_splits + offs_s               # (S,)
    m = tl.load(part_m_ptr + part, mask=mask_s, other=float("-inf"))    # (S,)
    l = tl.load(part_l_ptr + part, mask=mask_s, other=0.0)              # (S,)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :],
                  mask=mask_s[:, None], other=0.0)                      # (S, D)
    m_max = tl.max(m, 0)
    w = tl.where(m > float("-inf"), tl.exp2(m - m_max), 0.0)            # (S,)
    l_tot = tl.sum(w * l, 0)
    out = tl.sum(w[:, None] * acc, 0) / tl.where(l_tot > 0, l_tot, 1.0)  # (D,)
    tl.store(out_ptr + seq * stride_o_s + head * stride_o_h + offs_d,
             out.to(out_ptr.dtype.element_ty))


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """Flash-Decoding split heuristic.

    Split only when ``num_seqs * num_kv_heads`` programs would leave the GPU
    under-occupied (fewer than two programs per SM), and never make a split
    shorter than ``MIN_TOKENS_PER_SPLIT`` keys.
    """
    programs = max(1, num_seqs * num_kv_heads)
    target = 2 * max(1, num_sms)
    if programs >= target:
        return 1
    max_splits = max(1, max_seq_len // MIN_TOKENS_PER_SPLIT)
    return int(max(1, min(math.ceil(target / programs), max_splits)))


def _validate(query, k_cache, v_cache, block_tables, seq_lens) -> int:
    """Check all inputs; return the GQA group size. Raises ``TypeError``/``ValueError``."""
    _, _, num_kv_heads, head_dim = check_kv_cache(k_cache, v_cache)
    check_tensor("query", query, 3, FLOAT_DTYPES)
    check_cache_dtype(k_cache, query)
    group = check_heads(query, num_kv_heads, head_dim)
    check_tensor("block_tables", block_tables, 2, INDEX_DTYPES)
    check_tensor("seq_lens", seq_lens, 1, INDEX_DTYPES)
    num_seqs = query.shape[0]
    check_shape("seq_lens", seq_lens, (num_seqs,))
    if block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows; expected "
                         f"num_seqs = {num_seqs} (query.shape[0])")
    check_same_device(query=query, k_cache=k_cache, v_cache=v_cache,
                      block_tables=block_tables, seq_lens=seq_lens)
    return group


def _resolve_splits(num_splits, query, k_cache, seq_lens, max_seq_len) -> int:
    """Validate a given ``num_splits`` or choose one (may sync to read ``seq_lens.max()``)."""
    if num_splits is not None:
        if not isinstance(num_splits, int) or num_splits < 1:
            raise ValueError(f"num_splits must be a positive int or None, got {num_splits!r}")
        return num_splits
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max().item()) if seq_lens.numel() else 0
    num_sms = _num_sms(query.device.index) if query.device.type == "cuda" else 1
    return choose_num_splits(query.shape[0], k_cache.shape[2], max_seq_len, num_sms)


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int | None) -> int:
    """Streaming-multiprocessor count of a CUDA device (cached: the query is slow)."""
    index = torch.cuda.current_device() if device_index is None else device_index
    return torch.cuda.get_device_properties(index).multi_processor_count


def paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           num_splits: int | None = None, out: torch.Tensor | None = None,
                           max_seq_len: int | None = None,
                           alibi_slopes: torch.Tensor | None = None, alibi_bf16: bool = False) -> torch.Tensor:
    """Attention of one new token per sequence over its paged K/V context.

    Args:
        query: ``[num_seqs, num_heads, head_dim]`` float16/bfloat16/float32.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``,
            ``query``'s dtype, or bfloat16 / float8_e5m2 (widened per tile, then all in
            float32); ``num_heads % num_kv_heads == 0``, head_dim a
            power of two >= 16.
        block_tables: ``[num_seqs, max_blocks_per_seq]`` int32/int64.
        seq_lens: ``[num_seqs]`` int32/int64, context length including the new
            token (a sequence with length 0 gets a zero output).
        scale: softmax scale.
        num_splits: Flash-Decoding context splits; ``None`` chooses automatically
            from the batch size and ``max_seq_len``.
        out: optional preallocated ``[num_seqs, num_heads, head_dim]`` output.
        max_seq_len: optional host-side ``seq_lens.max()`` (avoids a device sync
            when ``num_splits`` is None).
        alibi_slopes: float32 ``[num_heads]`` on the query's device, or ``None``.
        alibi_bf16: transformers' Falcon form of the bias (see ``attention/alibi.py``).

    Returns:
        ``out``: ``[num_seqs, num_heads, head_dim]`` in ``query.dtype``.

    Raises:
        TypeError: wrong dtypes (e.g. a cache dtype the kernel does not read, float indices).
        ValueError: inconsistent shapes, head counts, strides or devices.
    """
    group = _validate(query, k_cache, v_cache, block_tables, seq_lens)
    check_alibi_slopes(alibi_slopes, query)
    out = check_out(out, query)
    num_seqs, num_heads, head_dim = query.shape
    if num_seqs == 0:
        return out
    splits = _resolve_splits(num_splits, query, k_cache, seq_lens, max_seq_len)
    f32 = dict(device=query.device, dtype=torch.float32)
    part_m = torch.empty((num_seqs, num_heads, splits), **f32) if splits > 1 else out
    part_l = torch.empty((num_seqs, num_heads, splits), **f32) if splits > 1 else out
    part_acc = torch.empty((num_seqs, num_heads, splits, head_dim), **f32) if splits > 1 else out
    num_kv_heads = k_cache.shape[2]
    _decode_kernel[(num_seqs, num_kv_heads, splits)](
        query, k_cache, v_cache, block_tables, seq_lens,
        query if alibi_slopes is None else alibi_slopes, out, part_m, part_l, part_acc,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), block_tables.stride(1),
        float(scale) * LOG2E, num_heads, splits,
        GROUP=group, BLOCK_G=max(16, next_pow2(group)), HEAD_DIM=head_dim,
        BLOCK_SIZE=k_cache.shape[1], BLOCK_N=BLOCK_N, SPLIT=splits > 1, ALIBI=alibi_slopes is not None,
        ALIBI_BF16=alibi_slopes is not None and alibi_bf16,
        num_warps=4, num_stages=2,
    )
    if splits > 1:
        _merge_kernel[(num_seqs, num_heads)](
            out, part_m, part_l, part_acc, out.stride(0), out.stride(1), num_heads, splits,
            HEAD_DIM=head_dim, BLOCK_S=next_pow2(splits), num_warps=4,
        )
    return out
