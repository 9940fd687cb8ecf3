"""The attention backend interface: what a model layer needs from paged attention.

A backend writes the step's new keys/values into the paged cache, then computes attention of the
new tokens over their whole context. The torch backend implements it on any device; the CPU backend
adds a compiled C++ op for decodes; a Triton backend (``pagedserve_kernels/``) takes the same
:class:`AttentionMetadata` and plugs in through this Protocol.
"""

from __future__ import annotations

from typing import Protocol

import torch

from pagedserve.engine.attention.metadata import AttentionMetadata
from pagedserve.engine.config import ATTENTION_BACKENDS


class AttentionBackend(Protocol):
    """Paged attention over a ``[num_blocks, block_size, num_kv_heads, head_dim]`` cache per layer."""

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, metadata: AttentionMetadata) -> None:
        """Stores ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` at ``metadata.slot_mapping``."""
        ...

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               key_cache: torch.Tensor, value_cache: torch.Tensor, metadata: AttentionMetadata,
               scale: float, alibi_slopes: torch.Tensor | None = None, alibi_bf16: bool = False) -> torch.Tensor:
        """Causal attention of the new tokens over their context; called after :meth:`write_kv`.

        Score of query head ``h`` at position ``i`` and key position ``j <= i``:
        ``scale * q.k - alibi_slopes[h] * (i - j)`` (ALiBi, Press et al., 2022, §3; the bias is
        added after scaling, see ``alibi.py``), or ``scale * q.k`` without slopes. With
        ``alibi_bf16`` (transformers' Falcon form): ``scale * (q.k + bf16(alibi_slopes[h] * bf16(j)))``.

        Args:
            query: ``[num_tokens, num_heads, head_dim]``.
            key, value: ``[num_tokens, num_kv_heads, head_dim]``, the new tokens' K/V (already in the cache).
            key_cache, value_cache: the layer's cache, ``[num_blocks, block_size, num_kv_heads, head_dim]``.
            metadata: the step's metadata.
            scale: softmax scale, usually ``head_dim ** -0.5``.
            alibi_slopes: float32 ``[num_heads]`` on the query's device, or ``None`` (no position bias).
                A property of the model's layer, passed on every call (see ``step.py``).
            alibi_bf16: the Falcon form of the bias above (ignored without slopes).

        Returns:
            ``[num_tokens, num_heads, head_dim]`` in ``query.dtype``.
        """
        ...


def make_attention_backend(name: str, device: torch.device | str):
    """The backend called ``name`` (``auto``, ``cpu``, ``torch`` or ``triton``) for ``device``.

    ``auto`` is Triton on CUDA and elsewhere ``cpu``: the compiled C++ op for decodes (built on first
    use, see ``cpu_op.py``), or ``torch`` with a warning when the op cannot be built. ``cpu`` is the
    same choice asked for explicitly.

    Raises:
        ValueError: an unknown name.
    """
    from pagedserve.engine.attention.cpu_backend import CpuAttentionBackend
    from pagedserve.engine.attention.cpu_op import load_cpu_attention_op
    from pagedserve.engine.attention.torch_backend import TorchAttentionBackend
    from pagedserve.engine.attention.triton_backend import TritonAttentionBackend

    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {name!r}")
    if name == "auto":
        name = "triton" if torch.device(device).type == "cuda" else "cpu"
    if name == "triton":
        return TritonAttentionBackend()
    op = load_cpu_attention_op() if name == "cpu" else None
    return CpuAttentionBackend(op) if op is not None else TorchAttentionBackend()
