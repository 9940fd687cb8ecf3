"""Paged prefill / extend attention for a ragged batch, in Triton.

Each sequence contributes ``q_len`` new tokens (the last ``q_len`` of its
``seq_len`` context positions, already written to the cache). They attend
causally among themselves and to the sequence's cached prefix, all read
through the block table.

Algorithm:
  * FlashAttention-2 (Dao 2023, §3.1 algorithm 1 and §3.2 parallelism): one
    program per (sequence, query head, tile of BLOCK_M queries); it streams
    BLOCK_N-key tiles with an online softmax (running max, sum, fp32 acc) and
    normalises once at the end. Key tiles entirely before the first query of
    the tile need no causal mask; only the tiles on the diagonal are masked,
    and tiles entirely after the last query are skipped.
  * Keys/values of a tile are gathered per token through the block table
    (PagedAttention, Kwon et al., SOSP 2023, §4.1), so any block size works.
  * ALiBi (Press et al., ICLR 2022, §3), when slopes are given (``ALIBI``):
    ``-slope[h] * (query_pos - key_pos)`` added to each scaled score (in base 2),
    on the unmasked tiles too; with ``ALIBI_BF16`` transformers' Falcon form
    ``scale * bf16(slope[h] * bf16(key_pos))``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve_kernels._alibi import round_bf16
from pagedserve_kernels._checks import (FLOAT_DTYPES, INDEX_DTYPES, check_alibi_slopes, check_heads, check_kv_cache, check_out,
                             check_same_device, check_cache_dtype, check_shape, check_tensor)

LOG2E = 1.4426950408889634


@triton.jit
def _attend_tiles(acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, bt_row_ptr, stride_bt_b,
                  kv_k_off, kv_v_off, stride_kc_b, stride_kc_s, stride_vc_b, stride_vc_s,
                  q_pos, lo, hi, kv_limit, qk_scale, slope,
                  HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                  CAUSAL: tl.constexpr, ALIBI: tl.constexpr, ALIBI_BF16: tl.constexpr):
    """Online-softmax update of (acc, l_i, m_i) with key tiles starting in [lo, hi)."""
    offs_d = tl.arange(0, HEAD_DIM)                                     # (D,)
    for tile in range(lo, hi, BLOCK_N):
        offs_n = tile + tl.arange(0, BLOCK_N)                           # (N,)
        mask_n = offs_n < kv_limit                                      # (N,)
        block = tl.load(bt_row_ptr + (offs_n // BLOCK_SIZE) * stride_bt_b,
                        mask=mask_n, other=0).to(tl.int64)              # (N,)
        slot_in_block = offs_n % BLOCK_SIZE                             # (N,)
        k_row = block * stride_kc_b + slot_in_block * stride_kc_s + kv_k_off   # (N,)
        v_row = block * stride_vc_b + slot_in_block * stride_vc_s + kv_v_off   # (N,)
        k = tl.load(k_cache_ptr + k_row[None, :] + offs_d[:, None],
                    mask=mask_n[None, :], other=0.0).to(q.dtype)        # (D, N)
        v = tl.load(v_cache_ptr + v_row[:, None] + offs_d[None, :],
                    mask=mask_n[:, None], other=0.0).to(q.dtype)        # (N, D)
        qk = tl.dot(q, k, input_precision="ieee") * qk_scale            # (M, N)
        if ALIBI_BF16:  # qk_scale * bf16(slope * bf16(key_pos)): scaled, in log2 units
            bias = round_bf16(slope * round_bf16(offs_n.to(tl.float32)))  # (N,)
            qk += bias[None, :] * qk_scale                              # (M, N)
        elif ALIBI:  # the scores are in log2 units
            qk += (slope * 1.4426950408889634) * (offs_n[None, :] - q_pos[:, None]).to(tl.float32)  # (M, N)
        if CAUSAL:
            visible = (offs_n[None, :] <= q_pos[:, None]) & mask_n[None, :]  # (M, N)
            qk = tl.where(visible, qk, float("-inf"))                   # (M, N)
        m_new = tl.maximum(m_i, tl.max(qk, 1))                          # (M,)
        alpha = tl.exp2(m_i - m_new)                                    # (M,)
        p = tl.exp2(qk - m_new[:, None])                                # (M, N)
        l_i = l_i * alpha + tl.sum(p, 1)                                # (M,)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")  # (M, D)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["stride_bt_s"])  # the block-table width varies step to step
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, slopes_ptr, out_ptr,
    stride_q_t, stride_q_h, stride_o_t, stride_o_h,
    stride_kc_b, stride_kc_s, stride_kc_h, stride_vc_b, stride_vc_s, stride_vc_h,
    stride_bt_s, stride_bt_b, qk_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ALIBI: tl.constexpr, ALIBI_BF16: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    m_start = tl.program_id(2) * BLOCK_M
    q_start = tl.load(qsl_ptr + seq).to(tl.int64)
    q_len = (tl.load(qsl_ptr + seq + 1) - q_start).to(tl.int32)
    if m_start >= q_len:  # this sequence has fewer query tiles
        return
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    ctx_len = seq_len - q_len                                           # cached prefix length
    kv_head = head // GROUP
    slope = 0.0
    if ALIBI:
        slope = tl.load(slopes_ptr + head)

    offs_m = m_start + tl.arange(0, BLOCK_M)                            # (M,)
    offs_d = tl.arange(0, HEAD_DIM)                                     # (D,)
    mask_m = offs_m < q_len                                             # (M,)
    q_rows = (q_start + offs_m) * stride_q_t + head * stride_q_h        # (M,)
    q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :],
                mask=mask_m[:, None], other=0.0)                        # (M, D)
    if k_cache_ptr.dtype.element_ty != q_ptr.dtype.element_ty:  # a narrower cache: widened per tile, float32
        q = q.to(tl.float32)
    q_pos = ctx_len + offs_m                                            # (M,)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)                 # (M,)
    l_i = tl.zeros([BLOCK_M], tl.float32)                               # (M,)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)                     # (M, D)
    # Keys [0, full_end) are visible to every query of the tile: no mask.
    full_end = ((ctx_len + m_start + 1) // BLOCK_N) * BLOCK_N
    # Keys beyond the tile's last query position are never visible.
    kv_end = tl.minimum(seq_len, ctx_len + m_start + BLOCK_M)
    bt_row_ptr = bt_ptr + seq * stride_bt_s
    kv_k_off = kv_head * stride_kc_h
    kv_v_off = kv_head * stride_vc_h
    acc, l_i, m_i = _attend_tiles(acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, bt_row_ptr,
                                  stride_bt_b, kv_k_off, kv_v_off, stride_kc_b, stride_kc_s,
                                  stride_vc_b, stride_vc_s, q_pos, 0, full_end, kv_end, qk_scale, slope,
                                  HEAD_DIM, BLOCK_SIZE, BLOCK_N, False, ALIBI,
                                  ALIBI_BF16)
    acc, l_i, m_i = _attend_tiles(acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, bt_row_ptr,
                                  stride_bt_b, kv_k_off, kv_v_off, stride_kc_b, stride_kc_s,
                                  stride_vc_b, stride_vc_s, q_pos, full_end, kv_end, kv_end,
                                  qk_scale, slope, HEAD_DIM, BLOCK_SIZE, BLOCK_N, True, ALIBI,
                                  ALIBI_BF16)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]                   # (M, D)
    o_rows = (q_start + offs_m) * stride_o_t + head * stride_o_h        # (M,)
    tl.store(out_ptr + o_rows[:, None] + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=mask_m[:, None])


def _validate(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
              max_query_len) -> int:
    """Check all inputs; return the GQA group size. Raises ``TypeError``/``ValueError``."""
    _, _, num_kv_heads, head_dim = check_kv_cache(k_cache, v_cache)
    check_tensor("query", query, 3, FLOAT_DTYPES)
    check_cache_dtype(k_cache, query)
    group = check_heads(query, num_kv_heads, head_dim)
    check_tensor("block_tables", block_tables, 2, INDEX_DTYPES)
    check_tensor("seq_lens", seq_lens, 1, INDEX_DTYPES)
    check_tensor("query_start_loc", query_start_loc, 1, INDEX_DTYPES)
    num_seqs = seq_lens.shape[0]
    check_shape("query_start_loc", query_start_loc, (num_seqs + 1,))
    if block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows; expected "
                         f"num_seqs = {num_seqs} (seq_lens.shape[0])")
    if isinstance(max_query_len, bool) or not isinstance(max_query_len, int) or max_query_len < 0:
        raise ValueError(f"max_query_len must be a non-negative int, got {max_query_len!r}")
    check_same_device(query=query, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                      seq_lens=seq_lens, query_start_loc=query_start_loc)
    return group


def paged_prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, seq_lens: torch.Tensor,
                            query_start_loc: torch.Tensor, scale: float, max_query_len: int,
                            out: torch.Tensor | None = None,
                            alibi_slopes: torch.Tensor | None = None, alibi_bf16: bool = False) -> torch.Tensor:
    """Causal attention of a ragged batch of new tokens over their paged context.

    Args:
        query: ``[num_tokens, num_heads, head_dim]`` float16/bfloat16/float32;
            sequence ``i`` owns rows ``query_start_loc[i]:query_start_loc[i+1]``.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``,
            ``query``'s dtype, or bfloat16 / float8_e5m2 (widened per tile, then all in
            float32); ``num_heads % num_kv_heads == 0``, head_dim a
            power of two >= 16.
        block_tables: ``[num_seqs, max_blocks_per_seq]`` int32/int64.
        seq_lens: ``[num_seqs]`` int32/int64, context length including the new
            tokens (so ``seq_lens[i] >= q_len_i``).
        query_start_loc: ``[num_seqs + 1]`` int32/int64 cumulative query lengths.
        scale: softmax scale.
        max_query_len: host-side upper bound of the per-sequence query lengths
            (sizes the launch grid; longer sequences would be left unwritten).
        out: optional preallocated output shaped like ``query``.
        alibi_slopes: float32 ``[num_heads]`` on the query's device, or ``None``.
        alibi_bf16: transformers' Falcon form of the bias (see ``attention/alibi.py``).

    Returns:
        ``out``: ``[num_tokens, num_heads, head_dim]`` in ``query.dtype``.

    Raises:
        TypeError: wrong dtypes (a cache dtype the kernel does not read, float index tensors).
        ValueError: inconsistent shapes, head counts, strides or devices.
    """
    group = _validate(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                      max_query_len)
    check_alibi_slopes(alibi_slopes, query)
    out = check_out(out, query)
    num_seqs, num_heads, head_dim = seq_lens.shape[0], query.shape[1], query.shape[2]
    if num_seqs == 0 or max_query_len == 0 or query.shape[0] == 0:
        return out
    block_m = 64 if max_query_len > 32 else max(16, 1 << (max_query_len - 1).bit_length())
    block_n = 64
    grid = (num_seqs, num_heads, triton.cdiv(max_query_len, block_m))
    _prefill_kernel[grid](
        query, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
        query if alibi_slopes is None else alibi_slopes, out,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), block_tables.stride(1), float(scale) * LOG2E,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_M=block_m, BLOCK_N=block_n, ALIBI=alibi_slopes is not None,
        ALIBI_BF16=alibi_slopes is not None and alibi_bf16, num_warps=4 if head_dim <= 64 else 8, num_stages=2,
    )
    return out
