"""The Llama family (Llama 2/3, SmolLM, Mistral, Qwen2) over a paged KV cache.

Decoder-only transformer (Touvron et al., 2023): pre-RMSNorm blocks of grouped-query attention
(Ainslie et al., 2023) with rotary positions and a SwiGLU MLP. The batch is one flat run of
tokens from many sequences without padding; attention finds each sequence's context through the
step's metadata, reached through the ``attention`` callable each layer is given (a
:class:`~pagedserve.engine.attention.step.StepAttention`, or its opaque compiled stand-in). q/k/v and
gate/up projections are fused into single matmuls.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from pagedserve.engine.models.decode_layers import DecodeLayers
from pagedserve.engine.models.llama_config import LlamaConfig
from pagedserve.engine.models.layers import GatedMLP, Linear, RMSNorm
from pagedserve.engine.models.fused_ops import apply_rotary
from pagedserve.engine.models.rope import RotaryEmbedding
from pagedserve.engine.models.sharded import ShardedCausalLM, reduce_partial
from pagedserve.engine.parallel.sharding import Slice, llama_checkpoint_slice
from pagedserve.engine.weight_loader import load_weights

if TYPE_CHECKING:
    from pagedserve.engine.parallel.group import TensorParallelGroup
    from pagedserve.engine.parallel.pipeline import PipelineStage

# attention(query [T, H, D], key [T, Hkv, D], value [T, Hkv, D], layer_index, scale) -> [T, H, D]:
# writes the step's K/V into the layer's cache, then attends over each sequence's context.
PagedAttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, float], torch.Tensor]


class LlamaAttention(nn.Module):
    """Self-attention with fused q/k/v rows ``[q (H*D); k (Hkv*D); v (Hkv*D)]``."""

    def __init__(self, config: LlamaConfig, layer_index: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.scale = config.head_dim ** -0.5
        qkv_out = config.q_size + 2 * config.kv_size
        self.qkv_proj = Linear(config.hidden_size, qkv_out, config.qkv_bias, dtype, device)
        self.o_proj = Linear(config.q_size, config.hidden_size, config.o_bias, dtype, device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attention: PagedAttentionFn) -> torch.Tensor:
        """``x`` ``[T, hidden]`` -> ``[T, hidden]``; ``attention`` writes this step's K/V into the cache."""
        num_tokens = x.shape[0]
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)                                            # (T, (H+2Hkv)*D)
        qk = qkv[:, : (heads + kv_heads) * dim].view(num_tokens, heads + kv_heads, dim)  # (T, H+Hkv, D)
        qk = apply_rotary(qk, cos, sin)                                   # (T, H+Hkv, D)
        q, k = qk[:, :heads], qk[:, heads:]                               # (T, H, D), (T, Hkv, D)
        v = qkv[:, (heads + kv_heads) * dim:].view(num_tokens, kv_heads, dim)  # (T, Hkv, D)
        o = attention(q, k, v, self.layer_index, self.scale)              # (T, H, D)
        return self.o_proj(o.reshape(num_tokens, heads * dim))           # (T, hidden)


class LlamaDecoderLayer(nn.Module):
    """``x + attn(norm(x))`` then ``x + mlp(norm(x))``; subclasses may swap ``attention_class``."""

    attention_class: type[nn.Module] = LlamaAttention
    parallel: TensorParallelGroup | None = None  # set by the model under tensor parallelism

    def __init__(self, config: LlamaConfig, layer_index: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.self_attn = self.attention_class(config, layer_index, dtype, device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.mlp = self.build_mlp(config, dtype, device)

    def build_mlp(self, config: LlamaConfig, dtype: torch.dtype, device: torch.device | str) -> nn.Module:
        """The feed-forward block, ``[T, hidden]`` -> ``[T, hidden]``: SwiGLU here; subclasses
        (e.g. Mixtral's sparse mixture of experts) return another."""
        return GatedMLP(config.hidden_size, config.intermediate_size, config.mlp_bias, dtype, device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attention: PagedAttentionFn) -> torch.Tensor:
        """``[T, hidden]`` -> ``[T, hidden]`` (updates ``x`` in place). Under tensor parallelism
        o_proj and down_proj are row-parallel: their partial sums meet in one all-reduce each
        (Shoeybi et al., 2019, §3)."""
        attn = self.self_attn(self.input_layernorm(x), cos, sin, attention)  # (T, hidden), partial under TP
        h = self.post_attention_layernorm.add_then_norm(x, reduce_partial(self.parallel, attn))  # x += attn
        mlp = self.mlp(h)                                                  # (T, hidden), partial under TP
        x += reduce_partial(self.parallel, mlp)
        return x


class LlamaForCausalLM(ShardedCausalLM):
    """A Llama-family causal LM; weights come from :func:`pagedserve.engine.weight_loader.load_weights`.

    Parameter names follow the Hugging Face ones without the ``model.`` prefix, except the fused
    ``self_attn.qkv_proj`` (q, k, v rows) and ``mlp.gate_up_proj`` (gate, up rows); see
    :meth:`fused_shards`. ``lm_head`` is absent when the embeddings are tied.

    Args:
        config: the parsed ``config.json``.
        dtype: parameter and activation dtype.
        device: where the parameters live.
        parallel: this rank's tensor-parallel group, or ``None`` (one rank). With a group the model
            holds only its Megatron-LM shard (``parallel/sharding.py``): ``config`` becomes the rank's
            (``H/T`` heads, its KV heads, ``I/T`` MLP width) so the attention callable and the KV
            cache see only this rank's heads; ``full_config`` keeps the checkpoint's.
        stage: this rank's pipeline stage, or ``None`` (every layer). A stage holds its consecutive
            layers (``layers[i]`` is checkpoint layer ``stage.first_layer + i``, and KV-cache layer
            ``i``), the embedding if first (or last with tied embeddings), the final norm and LM
            head if last; ``parallel/pipeline.py`` runs it (see ``models/sharded.py``).
    """

    decoder_layer_class: type[LlamaDecoderLayer] = LlamaDecoderLayer  # subclasses swap the block
    decode_layers: DecodeLayers | None = None  # the C++ loop for decode steps (models/decode_layers.py)

    def __init__(self, config: LlamaConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", parallel: TensorParallelGroup | None = None,
                 stage: PipelineStage | None = None) -> None:
        super().__init__()
        config = self.setup_parallel(config, parallel, stage)
        self.dtype = dtype
        self.embed_tokens = self.build_embedding(dtype, device)
        self.layers = self.build_layers(lambda i: self.decoder_layer_class(config, i, dtype, device))
        self.norm = self.build_final_norm(lambda: RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device))
        self.lm_head = self.build_lm_head(dtype, device)
        self.rotary = RotaryEmbedding(config.rope, config.head_dim).to(device)
        self.requires_grad_(False)

    def fused_shards(self) -> dict[str, dict[str, tuple[int, int]]]:
        """For each fused module name: checkpoint module name -> ``(first_row, num_rows)`` in it."""
        c = self.config
        return {
            "qkv_proj": {"q_proj": (0, c.q_size), "k_proj": (c.q_size, c.kv_size),
                         "v_proj": (c.q_size + c.kv_size, c.kv_size)},
            "gate_up_proj": {"gate_proj": (0, c.intermediate_size),
                             "up_proj": (c.intermediate_size, c.intermediate_size)},
        }

    def use_decode_layers(self) -> None:
        """Gives decode steps the C++ layer loop (``models/decode_layers.py``) where every layer is the
        plain one of this module (subclasses that swap a part keep the Python layers) and
        :meth:`DecodeLayers.build` finds the rest applies; call after packing the linear layers."""
        plain = all(type(layer) is LlamaDecoderLayer and type(layer.self_attn) is LlamaAttention
                    and type(layer.mlp) is GatedMLP and type(layer.input_layernorm) is RMSNorm
                    and type(layer.post_attention_layernorm) is RMSNorm for layer in self.layers)
        self.decode_layers = DecodeLayers.build(self) if plain and len(self.layers) else None

    def load_checkpoint(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Fills the parameters from Hugging Face checkpoint tensors (``WeightLoadError`` when they
        do not fit); see :func:`pagedserve.engine.weight_loader.load_weights`."""
        load_weights(self, tensors)

    def checkpoint_slice(self, name: str) -> Slice | None:
        """This rank's part of checkpoint tensor ``name`` (``parallel/sharding.py``)."""
        return llama_checkpoint_slice(name, self.shard)

    def run_layers(self, x: torch.Tensor, positions: torch.Tensor, attention: PagedAttentionFn) -> torch.Tensor:
        """The decoder layers over ``x`` ``[T, hidden]`` (int64 ``positions`` ``[T]``) -> ``[T, hidden]``."""
        cos, sin = self.rotary(positions, self.dtype)                     # (T, 1, D/2) each
        if self.decode_layers is not None and self.decode_layers.takes(x, cos, sin, attention):
            return self.decode_layers(x, cos, sin, attention)             # the same layers, in one C++ call
        for layer in self.layers:
            x = layer(x, cos, sin, attention)                             # (T, hidden)
        return x


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: the Llama layout (its sliding window is not applied: contexts are capped to it)."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: the Llama layout with q/k/v biases (set by the config parser)."""
