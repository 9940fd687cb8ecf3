"""GPT-NeoX (GPT-NeoX-20B, Pythia) over a paged KV cache.

Black et al., 2022, "GPT-NeoX-20B: An Open-Source Autoregressive Language Model", §2.1: pre-LayerNorm
blocks whose attention and MLP read the same input and add to it in parallel
(``x + attn(ln1(x)) + mlp(ln2(x))``; ``use_parallel_residual: false`` gives the sequential GPT
block), and rotary embeddings on only the first ``rotary_pct`` of each head's channels (rotate-half
pairing within those channels). The fused ``query_key_value`` of the checkpoint is head-interleaved
(rows ``[H, 3, D]``: per head its q, k, v); it is re-laid out into our ``[q; k; v]`` rows at load
time (:mod:`~pagedserve.engine.models.checkpoint_map`), so the forward pass splits it like Llama's.
Linear layers are :class:`~pagedserve.engine.models.layers.Linear` (oneDNN packs them).

Tensor parallelism (Megatron-LM; ``parallel/sharding.py``): a rank reads whole heads of the
``[H, 3, D]`` rows (contiguous) and re-lays them out like the whole model; ``dense_h_to_4h`` is
column-parallel, ``dense`` and ``dense_4h_to_h`` row-parallel (their biases on rank 0 only). The
parallel residual sums both branches' partial outputs before one all-reduce per layer (as vLLM's
Falcon does), the sequential block reduces each branch; embedding and ``embed_out`` are
vocabulary-parallel. Pipeline stages: see ``models/sharded.py``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.engine.models.checkpoint_map import grouped_qkv_order, load_renamed
from pagedserve.engine.models.gpt_config import GPTNeoXConfig
from pagedserve.engine.models.layers import LayerNorm, Linear
from pagedserve.engine.models.llama import PagedAttentionFn
from pagedserve.engine.models.fused_ops import apply_rotary
from pagedserve.engine.models.rope import RotaryEmbedding
from pagedserve.engine.models.sharded import ShardedCausalLM, reduce_partial
from pagedserve.engine.parallel.sharding import (ShardLayout, Slice, grouped_qkv_slice, rank_part, row_parallel,
                                                 vocab_rows)

_SKIPPED = (".attention.bias", ".attention.masked_bias", "rotary_emb.inv_freq")  # buffers old checkpoints saved
_RENAMES = {"embed_in": "embed_tokens", "final_layer_norm": "norm", "query_key_value": "qkv_proj",
            "embed_out": "lm_head"}


def apply_partial_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """Rotates the first ``rotary_dim`` channels of each head of ``x`` ``[T, n, D]`` by ``cos``/``sin``
    ``[T, 1, rotary_dim/2]`` (rotate-half within those channels); the rest pass. New ``[T, n, D]``."""
    if rotary_dim == x.shape[-1]:  # static: the config's widths
        return apply_rotary(x, cos, sin)                                  # (T, n, D)
    rotated = apply_rotary(x[..., :rotary_dim], cos, sin)                # (T, n, R)
    return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)              # (T, n, D)


class FusedQKVAttention(nn.Module):
    """Self-attention with fused q/k/v rows ``[q (H*D); k (Hkv*D); v (Hkv*D)]`` (re-laid out at
    load time), rotary on the first ``rotary_dim`` channels, output projection ``dense``.

    Args:
        num_heads, num_kv_heads, head_dim: geometry (``num_heads % num_kv_heads == 0``).
        rotary_dim: rotated channels per head (even, at most ``head_dim``).
        qkv_bias, dense_bias: whether the projections have biases.
    """

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, rotary_dim: int,
                 qkv_bias: bool, dense_bias: bool, layer_index: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.rotary_dim = rotary_dim
        self.scale = head_dim ** -0.5
        self.qkv_proj = Linear(hidden_size, (num_heads + 2 * num_kv_heads) * head_dim, qkv_bias, dtype, device)
        self.dense = Linear(num_heads * head_dim, hidden_size, dense_bias, dtype, device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attention: PagedAttentionFn) -> torch.Tensor:
        """``x`` ``[T, hidden]`` -> ``[T, hidden]``; ``attention`` writes this step's K/V into the cache."""
        num_tokens = x.shape[0]
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)                                            # (T, (H+2Hkv)*D)
        qk = qkv[:, : (heads + kv_heads) * dim].view(num_tokens, heads + kv_heads, dim)  # (T, H+Hkv, D)
        qk = apply_partial_rotary(qk, cos, sin, self.rotary_dim)          # (T, H+Hkv, D)
        q, k = qk[:, :heads], qk[:, heads:]                               # (T, H, D), (T, Hkv, D)
        v = qkv[:, (heads + kv_heads) * dim:].view(num_tokens, kv_heads, dim)  # (T, Hkv, D)
        o = attention(q, k, v, self.layer_index, self.scale)              # (T, H, D)
        return self.dense(o.reshape(num_tokens, heads * dim))             # (T, hidden)


class DenseGeluMLP(nn.Module):
    """``dense_4h_to_h(gelu(dense_h_to_4h(x)))`` (GPT-NeoX, Falcon)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, approximate: str,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.approximate = approximate
        self.dense_h_to_4h = Linear(hidden_size, intermediate_size, bias, dtype, device)
        self.dense_4h_to_h = Linear(intermediate_size, hidden_size, bias, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, hidden]`` -> ``[T, hidden]``."""
        h = F.gelu(self.dense_h_to_4h(x), approximate=self.approximate)  # (T, I)
        return self.dense_4h_to_h(h)                                      # (T, hidden)


def fused_qkv_checkpoint_slice(name: str, layout: ShardLayout, embeddings: tuple[str, ...]) -> Slice | None:
    """This rank's part of a GPT-NeoX or Falcon checkpoint tensor: ``query_key_value`` by KV-head
    groups, ``dense_h_to_4h`` column-parallel, ``dense``/``dense_4h_to_h`` row-parallel, the
    ``embeddings`` (and ``lm_head``) vocabulary-parallel, the rest (LayerNorms, buffers) whole."""
    parts = name.split(".")
    module, leaf = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", parts[-1])
    if module == "query_key_value":
        return grouped_qkv_slice(layout)
    if module == "dense_h_to_4h":
        return rank_part(layout, layout.intermediate_size)
    if module in ("dense", "dense_4h_to_h"):
        width = layout.num_heads * layout.head_dim if module == "dense" else layout.intermediate_size
        return row_parallel(layout, leaf, width)
    if module in embeddings or module == "lm_head":
        return vocab_rows(layout)
    return None


def qkv_row_orders(config) -> dict[str, torch.Tensor]:
    """The re-layout of the (rank's) fused QKV rows into ours; none when it is already ours (one KV
    head: ``[q; k; v]``), which spares a copy."""
    if config.num_kv_heads == 1:
        return {}
    return {"qkv_proj": grouped_qkv_order(config.num_heads, config.num_kv_heads, config.head_dim)}


class GPTNeoXLayer(nn.Module):
    """Parallel: ``x + attn(ln1(x)) + mlp(ln2(x))``; sequential: ``y = x + attn(ln1(x))``, ``y + mlp(ln2(y))``."""

    parallel = None  # the tensor-parallel group, set by the model

    def __init__(self, config: GPTNeoXConfig, layer_index: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        c = config
        self.use_parallel_residual = c.use_parallel_residual
        self.input_layernorm = LayerNorm(c.hidden_size, c.layer_norm_eps, True, dtype, device)
        self.post_attention_layernorm = LayerNorm(c.hidden_size, c.layer_norm_eps, True, dtype, device)
        self.attention = FusedQKVAttention(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.rotary_dim,
                                           c.attention_bias, c.attention_bias, layer_index, dtype, device)
        self.mlp = DenseGeluMLP(c.hidden_size, c.intermediate_size, True, c.gelu_approximate, dtype, device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attention: PagedAttentionFn) -> torch.Tensor:
        """``[T, hidden]`` -> ``[T, hidden]`` (sums in transformers' order; under TP the partial
        branch outputs meet in one all-reduce, parallel, or one each, sequential)."""
        attn = self.attention(self.input_layernorm(x), cos, sin, attention)  # (T, hidden)
        if self.use_parallel_residual:  # static: the config's
            if self.parallel is None:
                return self.mlp(self.post_attention_layernorm(x)) + attn + x     # (T, hidden)
            return self.parallel.all_reduce(self.mlp(self.post_attention_layernorm(x)) + attn) + x
        x = reduce_partial(self.parallel, attn) + x                           # (T, hidden)
        return reduce_partial(self.parallel, self.mlp(self.post_attention_layernorm(x))) + x  # (T, hidden)


class GPTNeoXForCausalLM(ShardedCausalLM):
    """A GPT-NeoX causal LM. Parameter names: the checkpoint's without ``gpt_neox.``, with
    ``embed_in`` -> ``embed_tokens``, ``final_layer_norm`` -> ``norm``, ``query_key_value`` ->
    ``qkv_proj`` (rows re-laid out) and ``embed_out`` -> ``lm_head`` (absent when tied).

    Args:
        config: the parsed ``config.json``.
        dtype: parameter and activation dtype.
        device: where the parameters live.
        parallel, stage: this rank's tensor-parallel group and pipeline stage (``models/sharded.py``).
    """

    checkpoint_embeddings = ("embed_in",)

    def __init__(self, config: GPTNeoXConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", parallel=None, stage=None) -> None:
        super().__init__()
        config = self.setup_parallel(config, parallel, stage)
        self.dtype = dtype
        self.embed_tokens = self.build_embedding(dtype, device)
        self.layers = self.build_layers(lambda i: GPTNeoXLayer(config, i, dtype, device))
        self.norm = self.build_final_norm(lambda: LayerNorm(config.hidden_size, config.layer_norm_eps, True, dtype,
                                                            device))
        self.lm_head = self.build_lm_head(dtype, device)
        self.rotary = RotaryEmbedding(config.rope, config.rotary_dim).to(device)
        self.requires_grad_(False)

    def checkpoint_name(self, name: str) -> str | None:
        """Checkpoint tensor name -> our parameter name (``None``: a buffer to skip)."""
        if name.endswith(_SKIPPED) or (self.config.tie_word_embeddings and name in ("embed_out.weight",
                                                                                   "lm_head.weight")):
            return None
        parts = name.removeprefix("gpt_neox.").split(".")
        return ".".join(_RENAMES.get(part, part) for part in parts)

    def checkpoint_slice(self, name: str) -> Slice | None:
        """This rank's part of checkpoint tensor ``name`` (``parallel/sharding.py``)."""
        return fused_qkv_checkpoint_slice(name, self.shard, ("embed_in", "embed_out"))

    def load_checkpoint(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Fills the parameters from a Hugging Face GPT-NeoX checkpoint (``WeightLoadError`` when
        tensors are missing, unexpected or mis-shaped); a rank's ``[H/T, 3, D]`` rows re-laid out alike."""
        load_renamed(self, tensors, self.checkpoint_name, qkv_row_orders(self.config))

    def run_layers(self, x: torch.Tensor, positions: torch.Tensor, attention: PagedAttentionFn) -> torch.Tensor:
        """The layers over ``x`` ``[T, hidden]`` (int64 ``positions`` ``[T]``) -> ``[T, hidden]``."""
        cos, sin = self.rotary(positions, self.dtype)                     # (T, 1, R/2) each
        for layer in self.layers:
            x = layer(x, cos, sin, attention)                             # (T, hidden)
        return x
