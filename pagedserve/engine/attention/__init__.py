"""Paged attention: per-step metadata, the backend interface, the CPU (C++ op), torch and Triton backends."""

from pagedserve.engine.attention.backend import AttentionBackend, make_attention_backend
from pagedserve.engine.attention.cpu_backend import CpuAttentionBackend
from pagedserve.engine.attention.metadata import (AttentionMetadata, ContextPrefill, DecodeChunk,
                                                FreshPrefill, build_attention_metadata,
                                                compute_positions)
from pagedserve.engine.attention.torch_backend import TorchAttentionBackend
from pagedserve.engine.attention.triton_backend import TritonAttentionBackend

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "ContextPrefill",
    "CpuAttentionBackend",
    "DecodeChunk",
    "FreshPrefill",
    "TorchAttentionBackend",
    "TritonAttentionBackend",
    "build_attention_metadata",
    "compute_positions",
    "make_attention_backend",
]
