"""Mixtral: the Mistral/Llama layout whose feed-forward block is a sparse mixture of experts.

Jiang et al., 2024, "Mixtral of Experts", §2.1: each layer's MLP is ``num_local_experts`` SwiGLU
experts and a router ``gate`` (``Linear(hidden -> experts)``); a token goes to the ``top_k``
(``num_experts_per_tok``, 2) experts of highest router probability and the block returns
``sum_i w_i * expert_i(x)`` with the top-k softmax weights renormalised to sum to 1 (as
transformers' ``MixtralSparseMoeBlock``). Attention, RMSNorms, rotary embedding and LM head are
those of :mod:`pagedserve.engine.models.llama`.

Each expert runs only on the tokens routed to it: the (token, slot) pairs are sorted by expert, each
expert gathers its rows, runs its SwiGLU MLP on them and scatter-adds the weighted result back. The
loop is over experts, never over tokens. That dispatch has data-dependent shapes (how many tokens an
expert gets), which inductor cannot put in a graph with a symbolic token count; it is the custom op
``pagedserve::moe_experts`` (opaque to ``torch.compile``, like the paged attention op in
``compiled.py``), so ``--compile-mode inductor`` compiles everything around it.

Checkpoints: the per-expert layout ``layers.N.block_sparse_moe.experts.E.w1/w2/w3.weight`` (what
transformers 5.x ``save_pretrained`` writes, and the published Mixtral checkpoints) and the fused
layout of transformers 5.x in memory (``layers.N.mlp.experts.gate_up_proj`` ``[E, 2I, H]``,
``...down_proj`` ``[E, H, I]``, ``layers.N.mlp.gate.weight``) both load.

Tensor parallelism (Megatron-LM, as vLLM without expert parallelism): attention as Llama's; the
router ``gate`` is whole on every rank (each routes the same all-reduced input alike); every
expert's w1/w3 are column-parallel (``I/T`` rows) and w2 row-parallel, so a rank's
:meth:`SparseMoeBlock.dispatch` sums its partial expert outputs and the layer's one all-reduce
after the MLP adds the ranks' partial sums (``LlamaDecoderLayer``).
"""

from __future__ import annotations

import itertools
import re
import weakref
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from pagedserve.engine.models.llama_config import MixtralConfig
from pagedserve.engine.models.layers import GatedMLP, Linear
from pagedserve.engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from pagedserve.engine.parallel.sharding import Slice, llama_checkpoint_slice, rank_part

_blocks: weakref.WeakValueDictionary[int, SparseMoeBlock] = weakref.WeakValueDictionary()
_ids = itertools.count()


@torch.library.custom_op("pagedserve::moe_experts", mutates_args=())
def moe_experts(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, block_id: int) -> torch.Tensor:
    """The experts of block ``block_id`` over their routed tokens (see :meth:`SparseMoeBlock.dispatch`)."""
    return _blocks[block_id].dispatch(x, weights, experts)


@moe_experts.register_fake
def _(x, weights, experts, block_id):
    return torch.empty_like(x)


class SparseMoeBlock(nn.Module):
    """Top-k routed SwiGLU experts (Mixtral §2.1): ``[T, hidden]`` -> ``[T, hidden]``.

    Modules: ``gate`` (router, ``[E, hidden]``, no bias) and ``experts`` (``E`` :class:`GatedMLP`
    with fused w1/w3 rows as ``gate_up_proj`` and w2 as ``down_proj``), all :class:`Linear`, so the
    oneDNN GEMM backend packs them like any other layer.
    """

    def __init__(self, config: MixtralConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.gate = Linear(config.hidden_size, config.num_local_experts, False, dtype, device)
        self.experts = nn.ModuleList(
            GatedMLP(config.hidden_size, config.intermediate_size, False, dtype, device)
            for _ in range(config.num_local_experts))
        self.block_id = next(_ids)
        _blocks[self.block_id] = self

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` ``[T, hidden]`` -> float32 weights ``[T, k]`` (renormalised to sum 1) and int64
        expert ids ``[T, k]``; softmax in float32 as transformers does."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)               # (T, E) float32
        weights, experts = probs.topk(self.top_k, dim=-1)                 # (T, k), (T, k)
        return weights / weights.sum(dim=-1, keepdim=True), experts       # (T, k) float32, (T, k)

    def dispatch(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Runs each expert on the tokens routed to it and sums the weighted outputs.

        Args:
            x: ``[T, hidden]`` in the model dtype.
            weights: float32 ``[T, k]``; ``weights[t, j]`` scales expert ``experts[t, j]`` for token t.
            experts: int64 ``[T, k]`` expert ids.

        Returns:
            ``[T, hidden]`` in ``x``'s dtype; zero for tokens with no expert (none, when k >= 1).
        """
        out = torch.zeros_like(x)                                         # (T, hidden)
        flat = experts.flatten()                                          # (T*k,)
        order = flat.argsort(stable=True)                                 # (T*k,) slots grouped by expert
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()  # E ints (one host sync)
        tokens = order // self.top_k                                      # (T*k,) token of each slot
        slot_weights = weights.flatten()[order]                           # (T*k,) float32
        start = 0
        for expert, count in zip(self.experts, counts):
            if count:
                rows = tokens[start:start + count]                        # (n,) this expert's tokens
                y = expert(x[rows])                                       # (n, hidden)
                y = y * slot_weights[start:start + count, None]           # (n, hidden) float32
                out.index_add_(0, rows, y.to(x.dtype))                    # (T, hidden)
                start += count
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, hidden]`` -> ``[T, hidden]``."""
        weights, experts = self.route(x)                                  # (T, k), (T, k)
        return moe_experts(x, weights, experts, self.block_id)            # (T, hidden)


class MixtralDecoderLayer(LlamaDecoderLayer):
    """A Llama decoder layer whose MLP is a :class:`SparseMoeBlock`."""

    def build_mlp(self, config: MixtralConfig, dtype: torch.dtype, device: torch.device | str) -> nn.Module:
        return SparseMoeBlock(config, dtype, device)


_PER_EXPERT = re.compile(r"\.block_sparse_moe\.(gate|experts\.(\d+)\.(w[123]))\.")
_EXPERT_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def _checkpoint_names(tensors: Iterable[tuple[str, torch.Tensor]],
                      intermediate: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Renames Mixtral checkpoint tensors to the Llama loader's names.

    ``...block_sparse_moe.experts.E.w1`` -> ``...mlp.experts.E.gate_proj`` (w3: ``up_proj``, w2:
    ``down_proj``; the loader fuses gate/up rows), ``block_sparse_moe.gate`` -> ``mlp.gate``; the
    fused ``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` and ``mlp.experts.down_proj`` ``[E, H, I]``
    are split into per-expert tensors.
    """
    for name, tensor in tensors:
        match = _PER_EXPERT.search(name)
        if match:
            module = match.group(1)
            if match.group(2) is not None:
                module = f"experts.{match.group(2)}.{_EXPERT_NAMES[match.group(3)]}"
            yield name[:match.start()] + f".mlp.{module}." + name[match.end():], tensor
        elif name.endswith(".mlp.experts.gate_up_proj"):
            prefix = name.removesuffix("gate_up_proj")                    # "...mlp.experts."
            for e, stacked in enumerate(tensor):                          # (2I, H) per expert
                yield f"{prefix}{e}.gate_proj.weight", stacked[:intermediate]  # (I, H)
                yield f"{prefix}{e}.up_proj.weight", stacked[intermediate:]    # (I, H)
        elif name.endswith(".mlp.experts.down_proj"):
            prefix = name.removesuffix("down_proj")
            for e, down in enumerate(tensor):                             # (H, I) per expert
                yield f"{prefix}{e}.down_proj.weight", down
        else:
            yield name, tensor


class MixtralForCausalLM(LlamaForCausalLM):
    """Mixtral (a :class:`LlamaForCausalLM` with :class:`SparseMoeBlock` MLPs); config
    :class:`MixtralConfig`. Parameters: ``layers.N.mlp.gate.weight`` ``[E, hidden]`` and
    ``layers.N.mlp.experts.E.{gate_up_proj,down_proj}.weight``."""

    decoder_layer_class = MixtralDecoderLayer

    def load_checkpoint(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Fills the parameters from either checkpoint layout (module docstring); ``WeightLoadError``
        when they do not fit."""
        super().load_checkpoint(_checkpoint_names(tensors, self.config.intermediate_size))

    def checkpoint_slice(self, name: str) -> Slice | None:
        """This rank's part of checkpoint tensor ``name``: Llama's, plus each expert's w1/w3 rows and
        w2 columns (fused ``[E, 2I, H]`` gate_up: the rank's rows of both halves; ``[E, H, I]``
        down: its columns); the router whole."""
        layout, width = self.shard, self.shard.intermediate_size
        match = _PER_EXPERT.search(name)
        if match and match.group(3) in ("w1", "w3"):
            return rank_part(layout, width)
        if match and match.group(3) == "w2":
            return rank_part(layout, width, dim=1)
        if name.endswith(".mlp.experts.gate_up_proj"):
            full, r = self.full_config.intermediate_size, layout.rank
            return Slice(1, ((r * width, (r + 1) * width), (full + r * width, full + (r + 1) * width)), 2 * width)
        if name.endswith(".mlp.experts.down_proj"):
            return rank_part(layout, width, dim=2)
        return llama_checkpoint_slice(name, layout)
