"""Qwen3 (dense) over a paged KV cache: the Llama layout with QK-norm.

Qwen3 (Qwen Team, "Qwen3 Technical Report", 2025, §2 "Architecture") keeps the Llama/Qwen2
decoder (pre-RMSNorm, grouped-query attention, RoPE, SwiGLU) but drops Qwen2's q/k/v biases and
adds *QK-norm*: an RMSNorm over ``head_dim`` (weights ``q_norm`` / ``k_norm``, ``[head_dim]``)
applied to each query and each key head after the projection and before the rotary embedding.
``head_dim`` comes from the config (it need not be ``hidden_size / num_heads``).
"""

from __future__ import annotations

import torch

from pagedserve.engine.models.llama_config import LlamaConfig
from pagedserve.engine.models.layers import RMSNorm
from pagedserve.engine.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, PagedAttentionFn
from pagedserve.engine.models.fused_ops import apply_rotary


class Qwen3Attention(LlamaAttention):
    """Llama attention plus per-head RMSNorm of q and k (``q_norm``, ``k_norm``: ``[head_dim]``)."""

    def __init__(self, config: LlamaConfig, layer_index: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__(config, layer_index, dtype, device)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype, device)
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype, device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attention: PagedAttentionFn) -> torch.Tensor:
        """``x`` ``[T, hidden]`` -> ``[T, hidden]``; ``cos``/``sin`` ``[T, 1, D/2]``."""
        num_tokens = x.shape[0]
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)                                            # (T, (H+2Hkv)*D)
        q = self.q_norm(qkv[:, : heads * dim].view(num_tokens, heads, dim))  # (T, H, D)
        k = self.k_norm(qkv[:, heads * dim: (heads + kv_heads) * dim].view(num_tokens, kv_heads, dim))  # (T, Hkv, D)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)       # (T, H, D), (T, Hkv, D)
        v = qkv[:, (heads + kv_heads) * dim:].view(num_tokens, kv_heads, dim)  # (T, Hkv, D)
        o = attention(q, k, v, self.layer_index, self.scale)              # (T, H, D)
        return self.o_proj(o.reshape(num_tokens, heads * dim))           # (T, hidden)


class Qwen3DecoderLayer(LlamaDecoderLayer):
    """The Llama decoder layer with :class:`Qwen3Attention`."""

    attention_class = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 causal LM: parameters as Hugging Face's (``model.`` dropped), q/k/v and gate/up fused
    as in :class:`LlamaForCausalLM`, plus ``layers.N.self_attn.q_norm.weight`` / ``k_norm.weight``
    ``[head_dim]``. Loaded by :func:`pagedserve.engine.weight_loader.load_weights`."""

    decoder_layer_class = Qwen3DecoderLayer
