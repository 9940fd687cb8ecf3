"""Plain-torch reference implementations of the paged-KV kernels.

These are the ground truth the Triton kernels are tested against, and a slow
fallback usable anywhere torch runs. They import only torch (never triton).

Layout (shared with the kernels):
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping:     [num_tokens] int, slot = block_id * block_size + offset
    block_tables:     [num_seqs, max_blocks_per_seq] int, logical -> physical block
    seq_lens:         [num_seqs] int, context length INCLUDING the new tokens
    query_start_loc:  [num_seqs + 1] int, cumulative query lengths

The paged layout is the one of PagedAttention (Kwon et al., "Efficient Memory
Management for Large Language Model Serving with PagedAttention", SOSP 2023, §4).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv_cache_ref(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter new keys/values into the paged cache in place.

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_dim]``, same dtype as the cache.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        slot_mapping: ``[num_tokens]`` int32/int64; negative slots are skipped
            (padding tokens).
    """
    block_size = k_cache.shape[1]
    slots = slot_mapping.long()                                   # (T,)
    keep = slots >= 0                                             # (T,)
    slots = slots[keep]
    blocks, offsets = slots // block_size, slots % block_size     # (T',), (T',)
    k_cache[blocks, offsets] = key[keep].to(k_cache.dtype)        # (T', Hkv, D)
    v_cache[blocks, offsets] = value[keep].to(v_cache.dtype)      # (T', Hkv, D)


def gather_kv(cache: torch.Tensor, block_table_row: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Gather one sequence's first ``seq_len`` cached tokens into a contiguous tensor.

    Returns ``[seq_len, num_kv_heads, head_dim]``.
    """
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    ids = block_table_row[:num_blocks].long()                     # (nb,)
    kv = cache[ids]                                               # (nb, bs, Hkv, D)
    return kv.reshape(-1, cache.shape[2], cache.shape[3])[:seq_len]  # (L, Hkv, D)


def paged_attention_ref(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, seq_lens: torch.Tensor,
                        query_start_loc: torch.Tensor, scale: float,
                        alibi_slopes: torch.Tensor | None = None, alibi_bf16: bool = False) -> torch.Tensor:
    """Causal attention of a ragged batch of new tokens over their paged context.

    Each sequence ``i`` has ``q_len = query_start_loc[i+1] - query_start_loc[i]``
    new tokens, which are the last ``q_len`` of its ``seq_lens[i]`` context
    positions; the query at position ``p`` attends to keys at positions ``<= p``.
    Decode is the case ``q_len == 1``. Computed in float32 and returned in
    ``query.dtype``.

    Args:
        query: ``[num_tokens, num_heads, head_dim]``; ``num_heads`` is a multiple
            of ``num_kv_heads`` (query head ``h`` uses KV head ``h // group``).
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        block_tables: ``[num_seqs, max_blocks_per_seq]`` int.
        seq_lens: ``[num_seqs]`` int. query_start_loc: ``[num_seqs + 1]`` int.
        scale: softmax scale (usually ``head_dim ** -0.5``).
        alibi_slopes: float32 ``[num_heads]`` or ``None``: ALiBi (Press et al., 2022, §3) adds
            ``-slope[h] * (q_pos - k_pos)`` to the scaled score of head ``h``.
        alibi_bf16: transformers' Falcon form instead: ``scale * bf16(slope[h] * bf16(k_pos))``.

    Returns:
        ``[num_tokens, num_heads, head_dim]`` in ``query.dtype``.
    """
    num_heads, num_kv_heads = query.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        q_start, q_end = starts[i], starts[i + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        k = gather_kv(k_cache, block_tables[i], seq_len).float()  # (L, Hkv, D)
        v = gather_kv(v_cache, block_tables[i], seq_len).float()  # (L, Hkv, D)
        k = k.repeat_interleave(group, dim=1).transpose(0, 1)     # (H, L, D)
        v = v.repeat_interleave(group, dim=1).transpose(0, 1)     # (H, L, D)
        q = query[q_start:q_end].float().transpose(0, 1)          # (H, q_len, D)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)  # (q_len,)
        k_pos = torch.arange(seq_len, device=query.device)                   # (L,)
        mask = k_pos[None, :] <= q_pos[:, None]                   # (q_len, L)
        if alibi_slopes is not None:
            rel = (k_pos[None, :] - q_pos[:, None]).float()       # (q_len, L)
            bias = alibi_slopes.float()[:, None, None] * rel      # (H, q_len, L)
            if alibi_bf16:
                absolute = alibi_slopes.float()[:, None] * k_pos.float().bfloat16().float()[None]  # (H, L)
                bias = (absolute.bfloat16().float() * scale)[:, None].expand(-1, q_len, -1)  # (H, q_len, L)
            mask = bias.masked_fill(~mask, float("-inf"))         # (H, q_len, L)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)  # (H, q_len, D)
        out[q_start:q_end] = o.transpose(0, 1).to(query.dtype)    # (q_len, H, D)
    return out


def paged_decode_attention_ref(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, seq_lens: torch.Tensor,
                               scale: float, alibi_slopes: torch.Tensor | None = None,
                               alibi_bf16: bool = False) -> torch.Tensor:
    """Decode special case of :func:`paged_attention_ref`: one query token per sequence.

    ``query`` is ``[num_seqs, num_heads, head_dim]``; returns the same shape.
    """
    num_seqs = query.shape[0]
    query_start_loc = torch.arange(num_seqs + 1, dtype=torch.int32, device=query.device)
    return paged_attention_ref(query, k_cache, v_cache, block_tables, seq_lens,
                               query_start_loc, scale, alibi_slopes, alibi_bf16)
