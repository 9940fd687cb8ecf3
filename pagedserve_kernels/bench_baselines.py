"""Batched torch baselines for ``pagedserve_kernels.bench`` (imports only torch).

Unlike :mod:`pagedserve_kernels.reference`, which loops over sequences in Python (fine for
tests, dominated by launch overhead on a GPU), these are the fastest
straightforward torch formulations: one gather of every sequence's blocks into
a padded contiguous K/V, then one ``scaled_dot_product_attention`` call. They
assume every sequence in the batch has the same context length and the same
query length (the benchmark cases are uniform).

GQA is handled without repeating K/V: the ``group`` query heads that share a
KV head are folded into the query-length dimension.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gather_batch(cache: torch.Tensor, block_tables: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Gather ``seq_len`` tokens of every sequence.

    Returns ``[num_seqs, num_kv_heads, seq_len, head_dim]`` (a strided view).
    """
    block_size, num_kv_heads, head_dim = cache.shape[1:]
    num_blocks = -(-seq_len // block_size)
    kv = cache[block_tables[:, :num_blocks].long()]              # (S, nb, bs, Hkv, D)
    kv = kv.view(kv.shape[0], num_blocks * block_size, num_kv_heads, head_dim)[:, :seq_len]
    return kv.transpose(1, 2)                                     # (S, Hkv, L, D)


def attention_torch(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_len: int, query_len: int,
                    scale: float) -> torch.Tensor:
    """Gather + SDPA attention for a uniform batch.

    Args:
        query: ``[num_seqs * query_len, num_heads, head_dim]`` (sequence-major).
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        block_tables: ``[num_seqs, max_blocks]`` int.
        seq_len: context length of every sequence (including the new tokens).
        query_len: new tokens per sequence (1 for decode).

    Returns:
        ``[num_seqs * query_len, num_heads, head_dim]`` in ``query.dtype``.
    """
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    num_seqs = query.shape[0] // query_len
    k = gather_batch(k_cache, block_tables, seq_len)              # (S, Hkv, L, D)
    v = gather_batch(v_cache, block_tables, seq_len)              # (S, Hkv, L, D)
    q = query.view(num_seqs, query_len, num_kv_heads, group, head_dim)
    q = q.permute(0, 2, 3, 1, 4).reshape(num_seqs, num_kv_heads, group * query_len, head_dim)
    mask = None
    if query_len > 1:
        q_pos = seq_len - query_len + torch.arange(query_len, device=query.device)  # (Lq,)
        q_pos = q_pos.repeat(group)                               # (G*Lq,)
        mask = torch.arange(seq_len, device=query.device)[None, :] <= q_pos[:, None]  # (G*Lq, L)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)  # (S, Hkv, G*Lq, D)
    o = o.view(num_seqs, num_kv_heads, group, query_len, head_dim).permute(0, 3, 1, 2, 4)
    return o.reshape(num_seqs * query_len, num_heads, head_dim)   # (T, H, D)


def write_kv_cache_torch(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                         v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """``index_copy_`` scatter of ``[num_tokens, num_kv_heads, head_dim]`` rows.

    Unlike the reference, negative (skipped) slots are not supported.
    """
    num_kv_heads, head_dim = k_cache.shape[2:]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)
