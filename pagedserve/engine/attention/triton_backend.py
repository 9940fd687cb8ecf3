"""Paged attention with the Triton kernels of ``pagedserve_kernels/`` (the GPU backend).

The kernels read K/V straight from the blocks through the block table (no gathered copies):
a decode-only batch uses the paged decode kernel (flash-decoding split for few, long sequences);
any batch with a prefill or chunk uses the prefill/extend kernel, which also handles the batch's
one-token sequences. On a CPU they run only under ``TRITON_INTERPRET=1`` (tests). A cache in a
narrower dtype than the query's (``--kv-cache-dtype``) is widened per tile inside the kernels. ALiBi slopes
(Press et al., 2022, §3) go to both kernels, which add the bias in their score loops.
"""

from __future__ import annotations

import torch

from pagedserve.engine.attention.metadata import AttentionMetadata
from pagedserve.engine.kv_cache import to_cache_dtype


class TritonAttentionBackend:
    """The :class:`~pagedserve.engine.attention.backend.AttentionBackend` built on ``pagedserve_kernels/``.

    Raises (from the kernels, before launch): ``ValueError``/``TypeError`` on shapes, dtypes or
    devices the kernels do not take (e.g. a head_dim that is not a power of two).
    """

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, metadata: AttentionMetadata) -> None:
        """Scatters ``key``/``value`` ``[T, Hkv, D]`` into the caches at ``metadata.slot_mapping``, rounded to
        the caches' dtype first (``kv_cache.to_cache_dtype``: torch's rounding, the other backends' too)."""
        from pagedserve_kernels import write_kv_cache

        write_kv_cache(to_cache_dtype(key, key_cache.dtype), to_cache_dtype(value, value_cache.dtype), key_cache,
                       value_cache, metadata.slot_mapping)

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               key_cache: torch.Tensor, value_cache: torch.Tensor, metadata: AttentionMetadata,
               scale: float, alibi_slopes: torch.Tensor | None = None, alibi_bf16: bool = False) -> torch.Tensor:
        """Causal attention of ``query`` ``[T, H, D]`` over the paged context -> ``[T, H, D]``;
        ``alibi_slopes``: float32 ``[H]`` or ``None``; ``alibi_bf16``: Falcon's form (see ``backend.py``)."""
        from pagedserve_kernels import paged_decode_attention, paged_prefill_attention

        if metadata.max_query_len == 1:
            return paged_decode_attention(query, key_cache, value_cache, metadata.block_tables, metadata.seq_lens,
                                          scale, max_seq_len=metadata.max_seq_len, alibi_slopes=alibi_slopes,
                                          alibi_bf16=alibi_bf16)
        return paged_prefill_attention(query, key_cache, value_cache, metadata.block_tables, metadata.seq_lens,
                                       metadata.query_start_loc, scale, metadata.max_query_len,
                                       alibi_slopes=alibi_slopes, alibi_bf16=alibi_bf16)
