"""Falcon with rotary positions (Falcon-7B/40B/180B, Falcon-11B) or ALiBi (falcon-rw) over a paged KV cache.

Almazrouei et al., 2023, "The Falcon Series of Open Language Models", §4: decoder blocks whose
attention and MLP both read the block input (parallel attention, Wang & Komatsuzaki's GPT-J
formulation: ``x + attn(ln(x)) + mlp(ln(x))``), multi-query attention (one K/V head; Falcon-7B)
or, in the "new decoder architecture" (Falcon-40B/180B), grouped K/V heads with separate LayerNorms
``ln_attn``/``ln_mlp`` in front of attention and MLP (one when ``num_ln_in_parallel_attn == 1``).
Rotary embeddings on the whole head; GELU MLP; LM head tied to the embeddings by default.

The fused ``query_key_value`` rows are, per variant: new decoder ``[Hkv, H/Hkv + 2, D]`` (each KV
head's query heads, then its key and value); ``multi_query`` ``[q (H*D); k (D); v (D)]`` (already
ours); neither ``[H, 3, D]`` (per head q, k, v). They are re-laid out into ours, ``[q; k; v]``, at
load time (:func:`~pagedserve.engine.models.checkpoint_map.grouped_qkv_order`).

The ALiBi variant (``alibi: true``; falcon-rw-1b/7b: ``[H, 3, D]`` rows, sequential block,
biases) has no rotary: every attention score gets ALiBi's bias (Press et al., ICLR 2022, §3), which
the attention backends add given per-head slopes (``attention/alibi.py``). As transformers'
``build_alibi_tensor`` does: the slopes are rounded to bfloat16, and the bias is added *before* the
``1/sqrt(head_dim)`` scaling, and ``slope * key_pos`` is computed in bfloat16 too
(``(q.k + bf16(slope * bf16(k_pos))) / sqrt(d)``): the layers ask the backends for that form
(``alibi_bf16=True``). Without the rounding, logits differ from transformers' by about 1e-2
(relative) within 300 tokens on slopes that are not powers of two (falcon-rw's 32 heads).

Tensor parallelism (Megatron-LM; ``parallel/sharding.py``): a rank reads its KV-head groups of
``query_key_value`` (whole groups when ``Hkv >= T``; else, the KV head replicated, its query rows
of its group plus that group's k and v: multi-query is one group) and re-lays them out like the
whole model; ``dense_h_to_4h`` is column-parallel, ``dense`` and ``dense_4h_to_h`` row-parallel
(biases on rank 0 only). A parallel block sums both branches' partial outputs before one
all-reduce (as vLLM's Falcon), a sequential one reduces each branch. Under ALiBi each rank passes
the slopes of its own heads (by their index in the checkpoint) to the backends. Embedding and an
untied ``lm_head`` are vocabulary-parallel. Pipeline stages: see ``models/sharded.py``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagedserve.engine.attention.alibi import alibi_slopes
from pagedserve.engine.models.checkpoint_map import load_renamed
from pagedserve.engine.models.gpt_config import FalconConfig
from pagedserve.engine.models.gpt_neox import (DenseGeluMLP, FusedQKVAttention, fused_qkv_checkpoint_slice,
                                               qkv_row_orders)
from pagedserve.engine.models.layers import LayerNorm
from pagedserve.engine.models.llama import PagedAttentionFn
from pagedserve.engine.models.rope import RotaryEmbedding
from pagedserve.engine.models.sharded import ShardedCausalLM, reduce_partial
from pagedserve.engine.parallel.sharding import Slice

_RENAMES = {"word_embeddings": "embed_tokens", "h": "layers", "ln_f": "norm", "query_key_value": "qkv_proj"}


class AlibiQKVAttention(FusedQKVAttention):
    """:class:`FusedQKVAttention` without rotary: the backends add ALiBi's bias, in transformers'
    Falcon form (``alibi_bf16``), from ``alibi_slopes``, a float32 ``[H]`` buffer of the
    bfloat16-rounded slopes of this layer's heads: heads ``[first_head, first_head + H)`` of the
    model's ``total_heads`` (a tensor-parallel rank's own heads; all of them by default)."""

    def __init__(self, c: FalconConfig, layer_index: int, dtype: torch.dtype, device: torch.device | str,
                 first_head: int = 0, total_heads: int | None = None) -> None:
        super().__init__(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.head_dim, c.bias, c.bias,
                         layer_index, dtype, device)
        every = alibi_slopes(total_heads or c.num_heads).bfloat16().float()          # (H_total,) float32
        slopes = every[first_head:first_head + c.num_heads]                         # (H,) float32
        self.register_buffer("alibi_slopes", slopes.to(device), persistent=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
                attention: PagedAttentionFn) -> torch.Tensor:
        """``x`` ``[T, hidden]`` -> ``[T, hidden]`` (``cos``/``sin`` unused)."""
        num_tokens = x.shape[0]
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)                                            # (T, (H+2Hkv)*D)
        q = qkv[:, : heads * dim].view(num_tokens, heads, dim)            # (T, H, D)
        k = qkv[:, heads * dim:(heads + kv_heads) * dim].view(num_tokens, kv_heads, dim)  # (T, Hkv, D)
        v = qkv[:, (heads + kv_heads) * dim:].view(num_tokens, kv_heads, dim)  # (T, Hkv, D)
        o = attention(q, k, v, self.layer_index, self.scale, self.alibi_slopes, True)  # (T, H, D)
        return self.dense(o.reshape(num_tokens, heads * dim))             # (T, hidden)


class FalconDecoderLayer(nn.Module):
    """Parallel: ``x + attn(ln_a(x)) + mlp(ln_m(x))`` (``ln_m = ln_a`` with one LayerNorm);
    sequential: ``y = x + attn(ln1(x))``, ``y + mlp(ln2(y))``. ``first_head``/``total_heads``: a
    tensor-parallel rank's heads among the model's (their ALiBi slopes)."""

    parallel = None  # the tensor-parallel group, set by the model

    def __init__(self, config: FalconConfig, layer_index: int, dtype: torch.dtype, device: torch.device | str,
                 first_head: int = 0, total_heads: int | None = None) -> None:
        super().__init__()
        c = config
        self.parallel_attn, self.two_norms = c.parallel_attn, c.num_layernorms == 2
        if self.two_norms:
            self.ln_attn = LayerNorm(c.hidden_size, c.layer_norm_eps, True, dtype, device)
            self.ln_mlp = LayerNorm(c.hidden_size, c.layer_norm_eps, True, dtype, device)
        else:
            self.input_layernorm = LayerNorm(c.hidden_size, c.layer_norm_eps, True, dtype, device)
        if not c.parallel_attn:
            self.post_attention_layernorm = LayerNorm(c.hidden_size, c.layer_norm_eps, True, dtype, device)
        self.self_attention = (AlibiQKVAttention(c, layer_index, dtype, device, first_head, total_heads) if c.alibi else
                               FusedQKVAttention(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.head_dim,
                                                 c.bias, c.bias, layer_index, dtype, device))
        self.mlp = DenseGeluMLP(c.hidden_size, c.intermediate_size, c.bias, c.gelu_approximate, dtype, device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
                attention: PagedAttentionFn) -> torch.Tensor:
        """``[T, hidden]`` -> ``[T, hidden]`` (sums in transformers' order; no ``cos``/``sin`` with
        ALiBi; under TP the partial branch outputs meet in one all-reduce, parallel, or one each)."""
        if self.two_norms:  # static: the config's
            attn_in, mlp_in = self.ln_attn(x), self.ln_mlp(x)            # (T, hidden) each
        else:
            attn_in = mlp_in = self.input_layernorm(x)                   # (T, hidden)
        attn = self.self_attention(attn_in, cos, sin, attention)          # (T, hidden), partial under TP
        if self.parallel_attn:
            if self.parallel is None:
                return self.mlp(mlp_in) + attn + x                        # (T, hidden)
            return self.parallel.all_reduce(self.mlp(mlp_in) + attn) + x  # (T, hidden)
        x = reduce_partial(self.parallel, attn) + x                       # (T, hidden)
        return reduce_partial(self.parallel, self.mlp(self.post_attention_layernorm(x))) + x  # (T, hidden)


class FalconForCausalLM(ShardedCausalLM):
    """A Falcon causal LM (rotary or ALiBi). Parameter names: the checkpoint's without ``transformer.``, with
    ``word_embeddings`` -> ``embed_tokens``, ``h`` -> ``layers``, ``ln_f`` -> ``norm`` and
    ``query_key_value`` -> ``qkv_proj`` (rows re-laid out); ``lm_head`` is absent when tied.

    Args:
        config: the parsed ``config.json``.
        dtype: parameter and activation dtype.
        device: where the parameters live.
        parallel, stage: this rank's tensor-parallel group and pipeline stage (``models/sharded.py``).
    """

    checkpoint_layer_lists = ("h",)
    checkpoint_embeddings = ("word_embeddings",)

    def __init__(self, config: FalconConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", parallel=None, stage=None) -> None:
        super().__init__()
        config = self.setup_parallel(config, parallel, stage)
        self.dtype = dtype
        first_head = 0 if self.shard is None else self.shard.head_start
        self.embed_tokens = self.build_embedding(dtype, device)
        self.layers = self.build_layers(lambda i: FalconDecoderLayer(config, i, dtype, device, first_head,
                                                                     self.full_config.num_heads))
        self.norm = self.build_final_norm(lambda: LayerNorm(config.hidden_size, config.layer_norm_eps, True, dtype,
                                                            device))
        self.lm_head = self.build_lm_head(dtype, device)
        self.rotary = None if config.rope is None else RotaryEmbedding(config.rope, config.head_dim).to(device)
        self.requires_grad_(False)

    def checkpoint_name(self, name: str) -> str | None:
        """Checkpoint tensor name -> our parameter name (``None``: skipped)."""
        if name.endswith("rotary_emb.inv_freq") or (self.config.tie_word_embeddings and name == "lm_head.weight"):
            return None
        parts = name.removeprefix("transformer.").split(".")
        return ".".join(_RENAMES.get(part, part) for part in parts)

    def checkpoint_slice(self, name: str) -> Slice | None:
        """This rank's part of checkpoint tensor ``name`` (``parallel/sharding.py``): the fused QKV
        by KV-head groups in each variant's layout (multi-query: one group)."""
        return fused_qkv_checkpoint_slice(name, self.shard, ("word_embeddings",))

    def load_checkpoint(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Fills the parameters from a Hugging Face Falcon checkpoint (``WeightLoadError`` when
        tensors are missing, unexpected or mis-shaped)."""
        # multi_query: Hkv = 1, already ours; neither: Hkv = H, the [H, 3, D] layout (a rank's alike)
        load_renamed(self, tensors, self.checkpoint_name, qkv_row_orders(self.config))

    def run_layers(self, x: torch.Tensor, positions: torch.Tensor, attention: PagedAttentionFn) -> torch.Tensor:
        """The layers over ``x`` ``[T, hidden]`` (int64 ``positions`` ``[T]``) -> ``[T, hidden]``."""
        cos = sin = None  # ALiBi: the positions live in the attention bias
        if self.rotary is not None:
            cos, sin = self.rotary(positions, self.dtype)                 # (T, 1, D/2) each
        for layer in self.layers:
            x = layer(x, cos, sin, attention)                             # (T, hidden)
        return x
