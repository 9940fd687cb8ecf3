"""Paged attention: per-step metadata, the backend interface and the torch backend."""

from services.worker.attention.backend import AttentionBackend
from services.worker.attention.metadata import (AttentionMetadata, ContextPrefill, DecodeChunk,
                                                FreshPrefill, build_attention_metadata,
                                                compute_positions)
from services.worker.attention.torch_backend import TorchAttentionBackend

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "ContextPrefill",
    "DecodeChunk",
    "FreshPrefill",
    "TorchAttentionBackend",
    "build_attention_metadata",
    "compute_positions",
]
