"""GPT-2 over a paged KV cache.

GPT-2 (Radford et al., 2019, "Language Models are Unsupervised Multitask Learners", §2.3 "Model"):
the GPT decoder with LayerNorm moved to the input of each sub-block and a final LayerNorm after the
last block. Learned absolute position embeddings (``wpe``) are added to the token embeddings
(``wte``); every head attends with scale ``1/sqrt(head_dim)`` (no grouped KV heads, no rotary);
the MLP is ``c_proj(gelu_new(c_fc(x)))`` with GELU's tanh approximation; the LM head is tied to
``wte``. Hugging Face stores the projections as ``Conv1D`` modules whose weights are transposed
(``[in, out]``); :func:`gpt2_checkpoint_name` maps the checkpoint names and says which to transpose.

Tensor parallelism (Megatron-LM; ``parallel/sharding.py``), on the Conv1D ``[in, out]`` layout:
``c_attn`` column-parallel (the rank's columns of q, of k and of v: its heads), ``mlp.c_fc``
column-parallel, ``attn.c_proj`` and ``mlp.c_proj`` row-parallel (rows of the stored ``[in, out]``
matrix; biases on rank 0 only), one all-reduce after each; ``wte`` (and the tied head)
vocabulary-parallel; ``wpe`` and the LayerNorms whole. Pipeline stages: ``wte`` and ``wpe`` on the
first stage (``wte`` on the last too, tied), ``ln_f`` on the last (``models/sharded.py``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from pagedserve.engine.models.gpt_config import GPT2Config
from pagedserve.engine.models.layers import Embedding, GeluMLP, LayerNorm, Linear
from pagedserve.engine.models.llama import PagedAttentionFn
from pagedserve.engine.models.sharded import ShardedCausalLM, reduce_partial
from pagedserve.engine.parallel.sharding import Slice, rank_part, row_parallel, vocab_rows
from pagedserve.engine.weight_loader import WeightLoadError, load_weights

_TOP_LEVEL = {"wte": "embed_tokens", "wpe": "embed_positions", "ln_f": "norm", "h": "layers"}
_CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
_BUFFERS = (".attn.bias", ".attn.masked_bias")  # causal-mask buffers older checkpoints saved


def gpt2_checkpoint_name(name: str) -> tuple[str, bool] | None:
    """A Hugging Face GPT-2 tensor name -> ``(our parameter name, stored transposed)``; ``None``
    for a saved causal-mask buffer. Names we do not know come back unchanged (the loader reports them).

    ``transformer.h.3.attn.c_attn.weight`` (or ``h.3.attn.c_attn.weight``) ->
    ``("layers.3.attn.c_attn.weight", True)``; ``transformer.wte.weight`` -> ``("embed_tokens.weight", False)``.
    """
    if name.endswith(_BUFFERS):
        return None
    name = name.removeprefix("transformer.")
    head, dot, rest = name.partition(".")
    name = _TOP_LEVEL.get(head, head) + dot + rest
    return name, name.startswith("layers.") and name.endswith(_CONV1D_WEIGHTS)


class GPT2Attention(nn.Module):
    """Multi-head self-attention with fused ``c_attn`` rows ``[q (H*D); k (H*D); v (H*D)]`` (``H*D``
    is ``hidden``, or a tensor-parallel rank's heads' share of it)."""

    def __init__(self, config: GPT2Config, layer_index: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.layer_index, self.num_heads, self.head_dim = layer_index, config.num_heads, config.head_dim
        self.scale = config.attention_scale
        width = config.num_heads * config.head_dim
        self.c_attn = Linear(config.hidden_size, 3 * width, True, dtype, device)
        self.c_proj = Linear(width, config.hidden_size, True, dtype, device)

    def forward(self, x: torch.Tensor, attention: PagedAttentionFn) -> torch.Tensor:
        """``x`` ``[T, hidden]`` -> ``[T, hidden]``; ``attention`` writes this step's K/V into the cache."""
        num_tokens, hidden = x.shape[0], self.num_heads * self.head_dim
        qkv = self.c_attn(x)                                              # (T, 3*hidden)
        q = qkv[:, :hidden].view(num_tokens, self.num_heads, self.head_dim)  # (T, H, D)
        k = qkv[:, hidden: 2 * hidden].view(num_tokens, self.num_heads, self.head_dim)  # (T, H, D)
        v = qkv[:, 2 * hidden:].view(num_tokens, self.num_heads, self.head_dim)  # (T, H, D)
        o = attention(q, k, v, self.layer_index, self.scale)              # (T, H, D)
        return self.c_proj(o.reshape(num_tokens, hidden))                 # (T, hidden)


class GPT2Block(nn.Module):
    """``x + attn(ln_1(x))`` then ``x + mlp(ln_2(x))`` (pre-LayerNorm, Radford et al. 2019 §2.3)."""

    parallel = None  # the tensor-parallel group, set by the model

    def __init__(self, config: GPT2Config, layer_index: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.ln_1 = LayerNorm(config.hidden_size, config.layer_norm_eps, True, dtype, device)
        self.attn = GPT2Attention(config, layer_index, dtype, device)
        self.ln_2 = LayerNorm(config.hidden_size, config.layer_norm_eps, True, dtype, device)
        self.mlp = GeluMLP(config.hidden_size, config.intermediate_size, True, config.gelu_approximate, dtype, device)

    def forward(self, x: torch.Tensor, attention: PagedAttentionFn) -> torch.Tensor:
        """``[T, hidden]`` -> ``[T, hidden]`` (updates ``x`` in place; one all-reduce per branch under TP)."""
        x += reduce_partial(self.parallel, self.attn(self.ln_1(x), attention))  # (T, hidden)
        x += reduce_partial(self.parallel, self.mlp(self.ln_2(x)))       # (T, hidden)
        return x


class GPT2LMHeadModel(ShardedCausalLM):
    """GPT-2 causal LM. Parameters: ``embed_tokens`` (``wte``), ``embed_positions`` (``wpe``),
    ``layers.N.{ln_1, attn.c_attn, attn.c_proj, ln_2, mlp.c_fc, mlp.c_proj}`` with weights ``[out, in]``
    (the checkpoint's Conv1D ``[in, out]`` transposed), ``norm`` (``ln_f``); ``lm_head`` is ``None``
    when tied to ``embed_tokens`` (the oneDNN packer then packs a copy of it).

    Args:
        config: the parsed ``config.json``.
        dtype: parameter and activation dtype.
        device: where the parameters live.
        parallel, stage: this rank's tensor-parallel group and pipeline stage (``models/sharded.py``).
    """

    checkpoint_layer_lists = ("h",)
    checkpoint_embeddings = ("wte",)
    checkpoint_first_stage = ("wpe",)

    def __init__(self, config: GPT2Config, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", parallel=None, stage=None) -> None:
        super().__init__()
        config = self.setup_parallel(config, parallel, stage)
        self.dtype = dtype
        self.embed_tokens = self.build_embedding(dtype, device)
        self.embed_positions = (Embedding(config.max_position_embeddings, config.hidden_size, dtype, device)
                                if self.is_first_stage else None)
        self.layers = self.build_layers(lambda i: GPT2Block(config, i, dtype, device))
        self.norm = self.build_final_norm(lambda: LayerNorm(config.hidden_size, config.layer_norm_eps, True, dtype,
                                                            device))
        self.lm_head = self.build_lm_head(dtype, device)
        self.requires_grad_(False)

    def checkpoint_slice(self, name: str) -> Slice | None:
        """This rank's part of checkpoint tensor ``name`` (Conv1D weights are ``[in, out]``)."""
        layout = self.shard
        parts = name.split(".")
        owner, module, leaf = ([""] * 3 + parts)[-3:]
        width = layout.num_heads * layout.head_dim                        # the rank's share of hidden
        if module == "c_attn":  # columns (weight) or entries (bias) of the rank's heads in q, k and v
            hidden, r = self.full_config.hidden_size, layout.rank
            ranges = tuple((i * hidden + r * width, i * hidden + (r + 1) * width) for i in range(3))
            return Slice(1 if leaf == "weight" else 0, ranges, 3 * width)
        if module == "c_fc":
            return rank_part(layout, layout.intermediate_size, dim=1 if leaf == "weight" else 0)
        if module == "c_proj" and owner in ("attn", "mlp"):  # Conv1D [in, out]: the rank's rows
            return row_parallel(layout, leaf, width if owner == "attn" else layout.intermediate_size, dim=0)
        if module in ("wte", "lm_head"):
            return vocab_rows(layout)
        return None

    def fused_shards(self) -> dict[str, dict[str, tuple[int, int]]]:
        """No fused shards: ``c_attn`` is already one matrix in the checkpoint."""
        return {}

    def load_checkpoint(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Fills the parameters from Hugging Face GPT-2 tensors (``transformer.`` prefix or none).

        Raises:
            WeightLoadError: missing, unexpected, duplicate or mis-shaped tensors (a Conv1D weight
                must be ``[in, out]``).
        """
        load_weights(self, self._renamed(tensors))

    def _renamed(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Checkpoint pairs -> pairs named and laid out as our parameters (buffers dropped)."""
        params = dict(self.named_parameters())
        for name, tensor in tensors:
            mapped = gpt2_checkpoint_name(name)
            if mapped is None:
                continue
            ours, transposed = mapped
            if ours not in params:  # the loader reports it (or skips a tied lm_head) by its own name
                yield name, tensor
                continue
            want = tuple(params[ours].shape[::-1] if transposed else params[ours].shape)
            if tuple(tensor.shape) != want:
                layout = "Conv1D [in, out] " if transposed else ""
                raise WeightLoadError(f"{name} has shape {tuple(tensor.shape)}; {layout}{want} expected")
            yield ours, (tensor.t() if transposed else tensor)            # Conv1D [in, out] -> [out, in]

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Token plus learned position embeddings: int64 ``[T]`` each -> ``[T, hidden]`` (positions
        ``< n_positions``)."""
        return self._embed(input_ids) + self.embed_positions(positions)  # (T, hidden)

    def run_layers(self, x: torch.Tensor, positions: torch.Tensor, attention: PagedAttentionFn) -> torch.Tensor:
        """The blocks over ``x`` ``[T, hidden]`` -> ``[T, hidden]`` (``positions`` unused: added by :meth:`embed`)."""
        for layer in self.layers:
            x = layer(x, attention)                                       # (T, hidden)
        return x
