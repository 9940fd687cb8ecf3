"""What every model class shares under tensor and pipeline parallelism.

A model is built whole (``parallel=None, stage=None``), as one tensor-parallel rank's shard
(``parallel``: the rank's group; Megatron-LM, Shoeybi et al., 2019, §3, see
``parallel/sharding.py``) and/or as one pipeline stage's consecutive layers (``stage``, see
``parallel/pipeline.py``). :class:`ShardedCausalLM` holds what does not depend on the architecture:
the rank's config (its heads and MLP width), the vocabulary-parallel embedding (masked lookup plus
an all-reduce) and LM head (an all-gather of the vocabulary shards of the logits), which stage
holds the embedding, the final norm and the head, which checkpoint tensors a stage reads, and the
forward as three steps a pipeline stage runs separately: :meth:`embed` (first stage),
:meth:`run_layers`, ``norm`` (last stage). A subclass builds its layers, says which slice of each
checkpoint tensor a rank holds (:meth:`checkpoint_slice`) and how its checkpoint names its layer
list and embeddings (for the stages).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pagedserve.engine.models.layers import Embedding, Linear, lm_head_logits
from pagedserve.engine.parallel.pipeline import PipelineStage, stage_checkpoint_name
from pagedserve.engine.parallel.sharding import ShardLayout, Slice, iter_checkpoint_parts, shard_layout

if TYPE_CHECKING:
    from pagedserve.engine.parallel.group import Collectives


def reduce_partial(parallel: Collectives | None, x: torch.Tensor) -> torch.Tensor:
    """A row-parallel layer's partial output summed over the tensor-parallel ranks (in place);
    ``x`` itself without a group."""
    return x if parallel is None else parallel.all_reduce(x)


class ShardedCausalLM(nn.Module):
    """Base of the model classes (see the module docstring).

    Class attributes (the checkpoint's names, for pipeline stages):
        checkpoint_layer_lists: the layer list's name (``layers.N``; ``h.N`` in GPT-2 and Falcon).
        checkpoint_embeddings: the token embedding's module names: the first stage holds it, and the
            last one too when the LM head is tied to it.
        checkpoint_first_stage: other modules only the first stage holds (GPT-2's learned positions).

    Attributes set by :meth:`setup_parallel`: ``full_config`` (the checkpoint's), ``config`` (this
    rank's heads and MLP width), ``parallel``, ``shard`` (a :class:`ShardLayout` or ``None``),
    ``stage`` and ``vocab_rows`` (this rank's embedding / head rows).
    """

    checkpoint_layer_lists: tuple[str, ...] = ("layers",)
    checkpoint_embeddings: tuple[str, ...] = ("embed_tokens",)
    checkpoint_first_stage: tuple[str, ...] = ()

    embed_tokens: Embedding | None
    lm_head: Linear | None
    norm: nn.Module | None

    def setup_parallel(self, config: Any, parallel: Collectives | None, stage: PipelineStage | None) -> Any:
        """Records the group and stage; returns the config this rank builds its layers from.

        Raises:
            ShardingError: the model cannot be split over the group's ranks.
        """
        self.full_config = config
        self.parallel = parallel
        self.stage = stage
        self.shard: ShardLayout | None = None
        self.vocab_rows = config.vocab_size
        if parallel is not None:
            self.shard = shard_layout(config, parallel.rank, parallel.world_size)
            config, self.vocab_rows = self.shard.local_config(config), self.shard.vocab_per_rank
        self.config = config
        return config

    @property
    def is_first_stage(self) -> bool:
        return self.stage is None or self.stage.is_first

    @property
    def is_last_stage(self) -> bool:
        return self.stage is None or self.stage.is_last

    @property
    def num_stage_layers(self) -> int:
        """The layers this model holds (``layers[i]`` is checkpoint layer ``stage.first_layer + i``)."""
        return self.config.num_layers if self.stage is None else self.stage.num_layers

    def use_decode_layers(self) -> None:
        """Runs decode steps' layers in one C++ call where the model has such a loop and it applies
        (Llama: ``models/decode_layers.py``); call after packing the linear layers. Here: nothing."""

    def build_embedding(self, dtype: torch.dtype, device: torch.device | str) -> Embedding | None:
        """The token embedding (this rank's vocabulary rows) if this stage holds it."""
        held = self.is_first_stage or (self.is_last_stage and self.config.tie_word_embeddings)
        return Embedding(self.vocab_rows, self.config.hidden_size, dtype, device) if held else None

    def build_layers(self, make_layer: Callable[[int], nn.Module]) -> nn.ModuleList:
        """This stage's layers, ``make_layer(i)`` for local index ``i`` (its KV-cache layer), each given
        the tensor-parallel group as ``parallel`` (for its all-reduces)."""
        layers = nn.ModuleList(make_layer(i) for i in range(self.num_stage_layers))
        for layer in layers:
            layer.parallel = self.parallel
        return layers

    def build_final_norm(self, make_norm: Callable[[], nn.Module]) -> nn.Module | None:
        """The final norm, ``make_norm()``, on the last stage; else ``None``."""
        return make_norm() if self.is_last_stage else None

    def build_lm_head(self, dtype: torch.dtype, device: torch.device | str) -> Linear | None:
        """The untied LM head (this rank's vocabulary rows) on the last stage, else ``None``."""
        if not self.is_last_stage or self.config.tie_word_embeddings:
            return None
        return Linear(self.config.hidden_size, self.vocab_rows, False, dtype, device)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """int64 ``[T]`` -> ``[T, hidden]``. Vocabulary-parallel under TP (Shoeybi et al., 2019, §3):
        each rank looks up the ids in its row range, zeros elsewhere, and an all-reduce sums them."""
        if self.parallel is None:
            return self.embed_tokens(input_ids)                           # (T, hidden)
        local = input_ids - self.shard.vocab_start                        # (T,)
        inside = (local >= 0) & (local < self.shard.vocab_per_rank)      # (T,) bool
        x = self.embed_tokens(local.clamp(0, self.shard.vocab_per_rank - 1))  # (T, hidden)
        x.mul_(inside.unsqueeze(1).to(x.dtype))
        return self.parallel.all_reduce(x)                                # (T, hidden)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The first stage's input: int64 ``input_ids``/``positions`` ``[T]`` -> ``[T, hidden]``."""
        return self._embed(input_ids)                                     # (T, hidden)

    def run_layers(self, x: torch.Tensor, positions: torch.Tensor, attention) -> torch.Tensor:
        """This model's (stage's) layers over ``x`` ``[T, hidden]`` -> ``[T, hidden]``."""
        raise NotImplementedError

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention) -> torch.Tensor:
        """Runs the decoder over a flat token batch.

        Args:
            input_ids: int64 ``[T]``.
            positions: int64 ``[T]``, each token's position in its sequence.
            attention: the step's paged attention (writes K/V into the cache, attends over it).

        Returns:
            Final-norm hidden states ``[T, hidden]`` in the model dtype.
        """
        x = self.embed(input_ids, positions)                              # (T, hidden)
        return self.norm(self.run_layers(x, positions, attention))        # (T, hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden`` ``[N, hidden]`` -> float32 logits ``[N, vocab]``. Under TP each rank computes its
        vocabulary shard ``[N, ceil(V/T)]``; an all-gather puts the full rows on every rank."""
        logits = lm_head_logits(hidden, self.lm_head, self.embed_tokens)  # (N, vocab or V/T)
        if self.parallel is None:
            return logits                                                 # (N, vocab)
        gathered = self.parallel.all_gather(logits, dim=1)                # (N, T*ceil(V/T))
        return gathered[:, : self.full_config.vocab_size]                 # (N, vocab)

    def checkpoint_slice(self, name: str) -> Slice | None:
        """The part of checkpoint tensor ``name`` this tensor-parallel rank holds (``None``: all of it)."""
        raise NotImplementedError

    def stage_checkpoint_name(self, name: str) -> str | None:
        """Checkpoint tensor ``name`` under this stage's layer numbering, or ``None`` if the stage
        does not hold it."""
        return stage_checkpoint_name(name, self.stage, self.full_config.tie_word_embeddings,
                                     self.checkpoint_layer_lists, self.checkpoint_embeddings,
                                     self.checkpoint_first_stage)

    def rank_checkpoint(self, folder: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
        """The ``(name, tensor)`` pairs this rank loads from the folder: only its stage's tensors,
        only its slice of each, one in memory at a time (for :meth:`load_checkpoint`)."""
        return iter_checkpoint_parts(folder, None if self.shard is None else self.checkpoint_slice,
                                     None if self.stage is None else self.stage_checkpoint_name)
