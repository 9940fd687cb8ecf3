"""Paged attention on CPU with the compiled C++ op (``csrc/paged_attention_cpu.cpp``) for decodes.

Decodes (one new token per sequence) read K/V in place through the block table: no gathered copy,
no padding to the longest context in a chunk. Prefills, with or without cached context, go to the
prefill op (``csrc/prefill_attention_cpu.cpp``, register-blocked products: with many query rows per key
a GEMM-like kernel beats the paged op's vector loops) without ALiBi where ``prefill_op_applies`` (float32,
or bfloat16 rows widened; on CPUs where ``cpu_features.own_kernels_preferred``), else to the torch
backend's paths (fused ``scaled_dot_product_attention``); docs/benchmarks.md measures all three.
ALiBi slopes (Press et al., 2022, §3) go to the paged op, which adds the bias in its own instantiation
of the score loop, and to the torch prefill paths.
"""

from __future__ import annotations

import torch

from pagedserve.engine.attention.cpu_op import LANES, PagedAttentionOp
from pagedserve.engine.attention.metadata import AttentionMetadata
from pagedserve.engine.attention.prefill_op import (IN_PLACE_MAX_TOKENS, prefill_attention_paged, prefill_attention,
                                                    prefill_op_applies)
from pagedserve.engine.attention.torch_backend import TorchAttentionBackend, attend_prefills, gathered_context
from pagedserve.engine.kv_cache import as_stored


class CpuAttentionBackend:
    """The :class:`~pagedserve.engine.attention.backend.AttentionBackend` for CPU with the C++ op.

    A head size that is not a multiple of 16 (the op's vector width) falls back to the torch
    backend for the whole step.

    Args:
        op: the loaded op (:func:`~pagedserve.engine.attention.cpu_op.load_cpu_attention_op`).
    """

    def __init__(self, op: PagedAttentionOp) -> None:
        self._op = op
        self._torch = TorchAttentionBackend()

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, metadata: AttentionMetadata) -> None:
        """Stores ``key``/``value`` ``[T, Hkv, D]`` at ``metadata.slot_mapping``."""
        self._torch.write_kv(key, value, key_cache, value_cache, metadata)

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               key_cache: torch.Tensor, value_cache: torch.Tensor, metadata: AttentionMetadata,
               scale: float, alibi_slopes: torch.Tensor | None = None, alibi_bf16: bool = False) -> torch.Tensor:
        """Causal attention of ``query`` ``[T, H, D]`` over the paged context; returns ``[T, H, D]``.
        ``alibi_slopes``: float32 ``[H]`` or ``None``; ``alibi_bf16``: Falcon's form (see ``backend.py``)."""
        if query.shape[-1] % LANES:
            return self._torch.attend(query, key, value, key_cache, value_cache, metadata, scale, alibi_slopes,
                                      alibi_bf16)
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)  # (T, H, D)
        n = metadata.num_decode_seqs
        if n:  # the first n sequences own the first n tokens, one each
            self._op(out[:n], query[:n].contiguous(), key_cache, value_cache, metadata.block_tables[:n],
                     metadata.seq_lens[:n], metadata.query_start_loc[:n + 1], scale, alibi_slopes, alibi_bf16)
        if not (metadata.fresh_prefills or metadata.context_prefills):
            return out
        if alibi_slopes is None and prefill_op_applies(query):
            _attend_prefills_with_op(out, query, key, value, key_cache, value_cache, metadata, scale)
        else:
            attend_prefills(out, query, key, value, key_cache, value_cache, metadata, scale, alibi_slopes,
                            alibi_bf16)
        return out


def _attend_prefills_with_op(out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             key_cache: torch.Tensor, value_cache: torch.Tensor, metadata: AttentionMetadata,
                             scale: float) -> None:
    """``attend_prefills`` through the prefill op: a fresh prefill reads its new K/V ``[q, Hkv, D]`` as the
    cache stores them; one with cached context reads its first ``context_len + q`` positions from the
    cache's blocks ``[NB, BS, Hkv, D]``: in place when the cache is float32 and the new tokens at most
    ``IN_PLACE_MAX_TOKENS``, else gathered (and widened). The same bits either way. The op computes in
    float32: a bfloat16 model's query and K/V are widened (exact), and ``out`` rounds the result once."""
    wide = torch.float32
    for seq in metadata.fresh_prefills:
        s, e = seq.query_start, seq.query_end
        out[s:e] = prefill_attention(query[s:e].to(wide), as_stored(key[s:e], key_cache.dtype).to(wide),
                                     as_stored(value[s:e], value_cache.dtype).to(wide), scale)
    for seq in metadata.context_prefills:
        s, e = seq.query_start, seq.query_end
        if key_cache.dtype == value_cache.dtype == wide and e - s <= IN_PLACE_MAX_TOKENS:
            out[s:e] = prefill_attention_paged(query[s:e].to(wide), key_cache, value_cache, seq.block_indices,
                                               seq.context_len, scale)
            continue
        length = seq.context_len + e - s
        k, v = (gathered_context(cache, seq, wide)[:length] for cache in (key_cache, value_cache))  # (L, Hkv, D)
        out[s:e] = prefill_attention(query[s:e].to(wide), k, v, scale)
