"""One step's paged attention as the model layers call it: write this step's K/V, then attend."""

from __future__ import annotations

import torch

from pagedserve.engine.attention.backend import AttentionBackend
from pagedserve.engine.attention.metadata import AttentionMetadata
from pagedserve.engine.kv_cache import KVCache


class StepAttention:
    """Binds the KV cache, the step's metadata and the backend for one forward pass.

    A layer calls ``attention(query, key, value, layer_index, scale)``, and an ALiBi model's layer
    ``attention(query, key, value, layer_index, scale, alibi_slopes, alibi_bf16)``: the slopes (float32 ``[H]``)
    belong to the layer (a buffer of it, the heads it owns), so they travel with each call rather
    than being set on the backend, which is shared by every model and layer; models without ALiBi
    pass nothing and every backend keeps its bias-free path. The model never sees the
    cache or the metadata, so its dense part can be compiled with this call left opaque (see
    ``pagedserve/engine/models/compiled.py``).

    Args:
        kv_cache: the paged cache; layer ``i`` uses ``kv_cache.layer(i)``.
        metadata: the step's slot mapping, block tables and lengths.
        backend: computes paged attention.
    """

    def __init__(self, kv_cache: KVCache, metadata: AttentionMetadata, backend: AttentionBackend) -> None:
        self.kv_cache = kv_cache
        self.metadata = metadata
        self.backend = backend

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_index: int,
                 scale: float, alibi_slopes: torch.Tensor | None = None, alibi_bf16: bool = False) -> torch.Tensor:
        """Stores ``key``/``value`` ``[T, Hkv, D]`` in layer ``layer_index``'s cache at the slot mapping,
        then returns the causal attention of ``query`` ``[T, H, D]`` over each sequence's context,
        ``[T, H, D]`` in ``query.dtype`` (with the ALiBi bias of ``alibi_slopes`` ``[H]`` if given, in
        transformers' Falcon form with ``alibi_bf16``: see ``backend.py``)."""
        key_cache, value_cache = self.kv_cache.layer(layer_index)
        self.backend.write_kv(key, value, key_cache, value_cache, self.metadata)
        if alibi_slopes is None:
            return self.backend.attend(query, key, value, key_cache, value_cache, self.metadata, scale)
        return self.backend.attend(query, key, value, key_cache, value_cache, self.metadata, scale,
                                   alibi_slopes=alibi_slopes, alibi_bf16=alibi_bf16)
