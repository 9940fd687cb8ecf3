"""Paged attention in plain torch (the CPU backend).

PagedAttention (Kwon et al., SOSP 2023, §4): keys and values live in fixed-size blocks; each
sequence reads its context through its block table. Here the context is gathered into contiguous
tensors and handed to ``scaled_dot_product_attention``:

* decode (one new token per sequence): such sequences in a few chunks, each gathered at once,
  whole blocks at a time (``index_select`` into a reused buffer), padded to the chunk's longest context and masked;
  grouped-query attention views the query heads of one KV head as a query "length"
  (``[Nd, Hkv, G, D]`` against ``[Nd, Hkv, L, D]``), so K/V are never repeated per head;
* prefill without cached context: the new K/V directly, causal;
* prefill with cached context (chunked prefill): gather the context, causal mask offset by it.

ALiBi (Press et al., 2022, §3; ``alibi.py``): with per-head slopes the additive masks above carry the
bias too (decode: padding mask + bias; prefill: causal mask + bias instead of ``is_causal``). Without
slopes (``None``, every rotary model) the paths are exactly the ones above.

Prefills broadcast K/V over the query heads of a group with a stride-0 ``expand``, which keeps
torch on its fused CPU attention kernel (``enable_gqa`` falls back to the unfused math path there).

A cache in a smaller dtype than the query's (``--kv-cache-dtype``) is widened per gathered chunk or
context, never as a whole; a fresh prefill attends over its new K/V rounded as the cache stores them
(``kv_cache.as_stored``), so a token's keys are the same numbers in every step that reads them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedserve.engine.attention import alibi
from pagedserve.engine.attention.metadata import AttentionMetadata, ContextPrefill, DecodeChunk
from pagedserve.engine.kv_cache import as_stored, store_rows


class TorchAttentionBackend:
    """The :class:`~pagedserve.engine.attention.backend.AttentionBackend` for CPU (works on any device).

    It keeps two gather buffers that grow to the largest decode chunk seen, so the per-layer gather
    does not allocate (large short-lived allocations cost page faults on CPU). Not thread-safe:
    one backend per model runner.
    """

    def __init__(self) -> None:
        self._key_buffer = torch.empty(0)
        self._value_buffer = torch.empty(0)

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, metadata: AttentionMetadata) -> None:
        """Stores ``key``/``value`` ``[T, Hkv, D]`` at ``metadata.slot_mapping``, rounded to the cache's
        dtype (``kv_cache.store_rows``: ``index_copy_`` into the flat ``[num_blocks * block_size, Hkv, D]``
        view of each cache)."""
        store_rows(key_cache, metadata.slot_mapping, key)
        store_rows(value_cache, metadata.slot_mapping, value)

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               key_cache: torch.Tensor, value_cache: torch.Tensor, metadata: AttentionMetadata,
               scale: float, alibi_slopes: torch.Tensor | None = None, alibi_bf16: bool = False) -> torch.Tensor:
        """Causal attention of ``query`` ``[T, H, D]`` over the paged context; returns ``[T, H, D]``.
        ``alibi_slopes``: float32 ``[H]`` or ``None``; ``alibi_bf16``: Falcon's form (see ``backend.py``)."""
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)  # (T, H, D)
        bf16_scale = scale if alibi_bf16 else None
        for chunk in metadata.decode_chunks:
            s, e = chunk.start, chunk.end
            mask = chunk.mask if alibi_slopes is None else alibi.decode_mask(
                chunk.mask, alibi_slopes, metadata.seq_lens[s:e], key_cache.shape[2], bf16_scale)  # (Nd, Hkv, G|1, L)
            out[s:e] = self._decode(query[s:e], key_cache, value_cache, chunk, scale, mask)
        attend_prefills(out, query, key, value, key_cache, value_cache, metadata, scale, alibi_slopes, alibi_bf16)
        return out

    def _gather(self, cache: torch.Tensor, blocks: torch.Tensor,
                buffer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Whole blocks ``blocks`` of the cache into the front of ``buffer`` (grown if too small).

        Returns:
            The buffer to keep, and the gathered ``[len(blocks) * BS, Hkv, D]`` view of it.
        """
        flat = cache.view(cache.shape[0], -1)                             # (NB, BS*Hkv*D)
        need = blocks.shape[0] * flat.shape[1]
        if buffer.numel() < need or buffer.dtype != cache.dtype or buffer.device != cache.device:
            buffer = torch.empty(need, dtype=cache.dtype, device=cache.device)
        target = buffer[:need].view(blocks.shape[0], flat.shape[1])       # (N, BS*Hkv*D)
        torch.index_select(flat, 0, blocks, out=target)
        return buffer, target.view(-1, cache.shape[2], cache.shape[3])    # (N*BS, Hkv, D)

    def _decode(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                chunk: DecodeChunk, scale: float, mask: torch.Tensor) -> torch.Tensor:
        """One new token per sequence of ``chunk``: ``query`` ``[Nd, H, D]`` -> ``[Nd, H, D]``;
        ``mask`` is ``chunk.mask`` or it plus the ALiBi bias, ``[Nd, Hkv, G, L]``."""
        num_seqs, num_heads, head_dim = query.shape
        num_kv_heads = key_cache.shape[2]
        self._key_buffer, k = self._gather(key_cache, chunk.block_indices, self._key_buffer)
        self._value_buffer, v = self._gather(value_cache, chunk.block_indices, self._value_buffer)
        shape = (num_seqs, chunk.padded_len, num_kv_heads, head_dim)
        k = k.view(shape).transpose(1, 2).to(query.dtype)                 # (Nd, Hkv, L, D)
        v = v.view(shape).transpose(1, 2).to(query.dtype)                 # (Nd, Hkv, L, D)
        q = query.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)  # (Nd, Hkv, G, D)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)  # (Nd, Hkv, G, D)
        return o.reshape(num_seqs, num_heads, head_dim)                   # (Nd, H, D)


def _grouped(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Head-major views for grouped-query attention without copying K/V per query head.

    ``query`` ``[q, H, D]``, ``key``/``value`` ``[L, Hkv, D]`` -> ``[Hkv, G, q, D]`` and two
    ``[Hkv, G, L, D]`` (stride 0 over ``G``); query head ``h`` reads KV head ``h // G``.
    """
    q_len, num_heads, head_dim = query.shape
    group = num_heads // num_kv_heads
    q = query.view(q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)   # (Hkv, G, q, D)
    shape = (num_kv_heads, group, key.shape[0], head_dim)
    k = key.transpose(0, 1)[:, None].expand(shape)                        # (Hkv, G, L, D)
    v = value.transpose(0, 1)[:, None].expand(shape)                      # (Hkv, G, L, D)
    return q, k, v


def _heads_last(o: torch.Tensor) -> torch.Tensor:
    """``[Hkv, G, q, D]`` -> ``[q, H, D]``."""
    num_kv_heads, group, q_len, head_dim = o.shape
    return o.permute(2, 0, 1, 3).reshape(q_len, num_kv_heads * group, head_dim)


def attend_prefills(out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    key_cache: torch.Tensor, value_cache: torch.Tensor, metadata: AttentionMetadata,
                    scale: float, alibi_slopes: torch.Tensor | None = None, alibi_bf16: bool = False) -> None:
    """Writes into ``out`` ``[T, H, D]`` the attention of every sequence after the leading decodes:
    fresh prefills on their new K/V, prefills with cached context on a gathered copy of it
    (with the ALiBi bias of ``alibi_slopes`` float32 ``[H]`` unless ``None``, in Falcon's form
    with ``alibi_bf16``)."""
    bf16_scale = scale if alibi_bf16 else None
    for seq in metadata.fresh_prefills:
        s, e = seq.query_start, seq.query_end
        out[s:e] = _causal(query[s:e], as_stored(key[s:e], key_cache.dtype), as_stored(value[s:e], value_cache.dtype),
                           scale, alibi_slopes, bf16_scale)
    for seq in metadata.context_prefills:
        out[seq.query_start:seq.query_end] = _with_context(query, key_cache, value_cache, seq, scale, alibi_slopes,
                                                           bf16_scale)


def _causal(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
            alibi_slopes: torch.Tensor | None, bf16_scale: float | None) -> torch.Tensor:
    """Causal self-attention of one sequence's new tokens: ``[q, H, D]`` x ``[q, Hkv, D]`` -> ``[q, H, D]``."""
    if alibi_slopes is None:
        return sdpa_prefill(query, key, value, scale)
    q, k, v = _grouped(query, key, value, key.shape[1])
    q_pos = torch.arange(query.shape[0], device=query.device)            # (q,)
    mask = alibi.prefill_mask(alibi_slopes, q_pos, key.shape[0], key.shape[1], None, query.dtype,
                              bf16_scale)                                 # (Hkv, G, q, q)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)  # (Hkv, G, q, D)
    return _heads_last(o)                                                 # (q, H, D)


def sdpa_prefill(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    """torch's causal attention of a sequence's ``q`` new tokens over its ``L`` positions, the new ones last
    (new token ``i`` reads keys ``0 .. L - q + i``): ``[q, H, D]`` x ``[L, Hkv, D]`` -> ``[q, H, D]``. The
    fresh prefills' kernel without the prefill op, and the op's baseline in ``bench prefill-attention``."""
    q, k, v = _grouped(query, key, value, key.shape[1])
    offset = key.shape[0] - query.shape[0]
    if offset == 0:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)  # (Hkv, G, q, D)
    else:
        allowed = (torch.arange(key.shape[0], device=query.device)[None, :]
                   <= torch.arange(query.shape[0], device=query.device)[:, None] + offset)  # (q, L)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)  # (Hkv, G, q, D)
    return _heads_last(o)                                                 # (q, H, D)


def gathered_context(cache: torch.Tensor, seq: ContextPrefill, dtype: torch.dtype) -> torch.Tensor:
    """A copy of ``seq``'s whole blocks of one layer's ``cache`` ``[NB, BS, Hkv, D]``, in order and in ``dtype``:
    ``[Lp, Hkv, D]`` with ``Lp`` = blocks x block size (positions past its length are the last block's tail)."""
    return cache.index_select(0, seq.block_indices).flatten(0, 1).to(dtype)


def _with_context(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                  seq: ContextPrefill, scale: float, alibi_slopes: torch.Tensor | None,
                  bf16_scale: float | None) -> torch.Tensor:
    """New tokens of one sequence over its cached context plus themselves -> ``[q, H, D]``."""
    mask = seq.mask                                                       # (q, Lp)
    if alibi_slopes is not None:
        q_pos = torch.arange(seq.query_end - seq.query_start, device=mask.device) + seq.context_len  # (q,)
        mask = alibi.prefill_mask(alibi_slopes, q_pos, mask.shape[1], key_cache.shape[2], mask,
                                  query.dtype, bf16_scale)                # (Hkv, G, q, Lp)
    k, v = gathered_context(key_cache, seq, query.dtype), gathered_context(value_cache, seq, query.dtype)
    q, k, v = _grouped(query[seq.query_start:seq.query_end], k, v, key_cache.shape[2])
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)  # (Hkv, G, q, D)
    return _heads_last(o)                                                 # (q, H, D)
