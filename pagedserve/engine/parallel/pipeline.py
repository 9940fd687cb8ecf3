"""Pipeline parallelism inside one worker: consecutive layers per stage (GPipe, Huang et al., 2019).

A worker of ``T x P`` ranks: rank ``r`` is tensor-parallel rank ``r % T`` of stage ``r // T``.
Stage ``s`` holds layers ``[first_layer, first_layer + num_layers)`` (the ``L`` layers split as
evenly as possible, the first ``L % P`` stages one more) and a KV cache of only those layers.
Every rank applies every BatchPlan to its own request states (as under TP); in the forward, stage
0 embeds the tokens (GPT-2: plus its learned positions), each stage runs its layers and sends the
hidden states ``[tokens, hidden]`` to the same tensor-parallel rank of the next stage (gloo
``send``/``recv``; no architecture's layers carry a separate residual). The last stage applies
the final norm, computes the logits and samples (its tensor-parallel rank 0, with the same
per-request seeds as one rank); the other stages learn the sampled tokens with the next plan of
the same virtual engine
(``pipeline_runner.py``, which also hands the plans out). With speculation the first stage drafts
(n-gram or a draft model) and passes the drafts on before the activations (``stage_drafts.py``), the
last stage verifies, and the other stages count the accepted drafts as computed when those tokens come.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pagedserve.engine.grammar_matchers import GrammarCompiler
from pagedserve.engine.messages import PromptLogprobs, SampledToken, SequenceId
from pagedserve.engine.model_runner import ModelRunner, ScheduledRequest, batch_order
from pagedserve.engine.parallel.group import TensorParallelGroup
from pagedserve.engine.spec_decode.lookahead import kept_blocks
from pagedserve.engine.spec_decode.proposer import Proposer


class PipelineError(ValueError):
    """The model cannot be split into this many pipeline stages."""


@dataclass(frozen=True)
class PipelineStage:
    """Which layers one stage holds.

    Attributes:
        index: the stage, ``0 <= index < num_stages``.
        num_stages: the pipeline-parallel size P.
        first_layer: the checkpoint index of the stage's first layer.
        num_layers: how many consecutive layers it holds.
        max_stage_layers: the most layers any stage holds (every rank sizes its KV blocks by it, so
            that all ranks have the same number of blocks).
    """

    index: int
    num_stages: int
    first_layer: int
    num_layers: int
    max_stage_layers: int

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1


def pipeline_stage(num_layers: int, index: int, num_stages: int) -> PipelineStage:
    """Stage ``index`` of ``num_stages`` over ``num_layers`` layers (the first ``L % P`` stages get one more).

    Raises:
        PipelineError: more stages than layers, or a size below 1.
    """
    if num_stages < 1 or num_stages > num_layers:
        raise PipelineError(f"pipeline_parallel_size must be between 1 and the model's {num_layers} layers, "
                            f"got {num_stages}; use fewer stages")
    base, extra = divmod(num_layers, num_stages)
    first = index * base + min(index, extra)
    return PipelineStage(index, num_stages, first, base + (index < extra), base + (extra > 0))


def stage_checkpoint_name(name: str, stage: PipelineStage, tied: bool, layer_lists: tuple[str, ...] = ("layers",),
                          embeddings: tuple[str, ...] = ("embed_tokens",),
                          first_only: tuple[str, ...] = ()) -> str | None:
    """The model's name for checkpoint tensor ``name`` on ``stage`` (``model.layers.7.x`` ->
    ``model.layers.3.x`` on a stage starting at layer 4), or ``None`` if the stage does not hold it.

    Args:
        layer_lists: the checkpoint's names of the layer list (``h`` in GPT-2 and Falcon).
        embeddings: the token embedding's module names (first stage; last too when ``tied``).
        first_only: other modules of the first stage only (GPT-2's learned positions ``wpe``).
        The rest (final norm, LM head) belongs to the last stage.
    """
    parts = name.split(".")
    lists = [i for i, part in enumerate(parts[:-1]) if part in layer_lists and parts[i + 1].isdigit()]
    if lists:
        at = lists[0] + 1
        local = int(parts[at]) - stage.first_layer
        if not 0 <= local < stage.num_layers:
            return None
        return ".".join([*parts[:at], str(local), *parts[at + 1:]])
    module = parts[-2] if len(parts) >= 2 else ""
    if module in embeddings:
        return name if stage.is_first or (stage.is_last and tied) else None
    if module in first_only:
        return name if stage.is_first else None
    return name if stage.is_last else None  # the final norm and the LM head


@dataclass(frozen=True)
class RankPosition:
    """Where a rank sits in the ``T x P`` grid: ``rank = stage * T + tp_rank``."""

    rank: int
    tensor_parallel_size: int
    pipeline_parallel_size: int

    @property
    def stage(self) -> int:
        return self.rank // self.tensor_parallel_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tensor_parallel_size

    @property
    def last_stage_leader(self) -> int:
        """The rank that samples: tensor-parallel rank 0 of the last stage."""
        return (self.pipeline_parallel_size - 1) * self.tensor_parallel_size

    def stage_ranks(self) -> list[tuple[int, ...]]:
        """The ranks of each stage (its tensor-parallel group), stage by stage."""
        t = self.tensor_parallel_size
        return [tuple(range(s * t, (s + 1) * t)) for s in range(self.pipeline_parallel_size)]


class StageForward:
    """One stage's forward (the ``forward`` a :class:`ModelRunner` calls): receive or embed, run
    the stage's layers, send on (or apply the final norm on the last stage). ``comm_s`` adds up the
    seconds spent in :meth:`send_next`/:meth:`recv_prev` (waiting for a neighbour stage included; the
    drafts of ``stage_drafts.py`` go over them too).

    Args:
        model: the stage's model (a :class:`~pagedserve.engine.models.sharded.ShardedCausalLM`
            built with ``stage=``).
        position: this rank in the grid.
        world: the group of all ranks (point-to-point between stages).
    """

    def __init__(self, model, position: RankPosition, world: TensorParallelGroup) -> None:
        self.model = model
        self.stage: PipelineStage = model.stage
        self.world = world
        self.prev_rank = position.rank - position.tensor_parallel_size
        self.next_rank = position.rank + position.tensor_parallel_size
        self.comm_s = 0.0

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, attention) -> torch.Tensor:
        """int64 ``input_ids`` / ``positions`` ``[T]`` -> this stage's output ``[T, hidden]``
        (final-norm hidden states on the last stage). Raises :class:`CollectiveError` when a peer fails."""
        model = self.model
        if self.stage.is_first:
            x = model.embed(input_ids, positions)                         # (T, hidden)
        else:
            x = self.recv_prev(torch.empty(input_ids.shape[0], model.config.hidden_size, dtype=model.dtype,
                                           device=input_ids.device))     # (T, hidden)
        x = model.run_layers(x, positions, attention)                     # (T, hidden)
        if not self.stage.is_last:
            self.send_next(x)
            return x
        return model.norm(x)                                              # (T, hidden)

    def send_next(self, tensor: torch.Tensor) -> None:
        """Sends ``tensor`` to the same tensor-parallel rank of the next stage (timed into ``comm_s``)."""
        start = time.perf_counter()
        self.world.send(tensor, self.next_rank)
        self.comm_s += time.perf_counter() - start

    def recv_prev(self, tensor: torch.Tensor) -> torch.Tensor:
        """Receives into ``tensor`` from the same tensor-parallel rank of the stage before (timed); returns it."""
        start = time.perf_counter()
        self.world.recv(tensor, self.prev_rank)
        self.comm_s += time.perf_counter() - start
        return tensor


class StageRunner(ModelRunner):
    """A pipeline rank's ModelRunner for one virtual engine: the same plan bookkeeping on every rank;
    the last stage computes the logits and samples, the other stages only run their layers and
    learn the sampled tokens later (:meth:`append_sampled`, with the virtual engine's next plan).

    Args:
        model, kv_cache, attention_backend, sampler: as :class:`ModelRunner` (``sampler`` is used
            on the last stage only).
        forward: the rank's :class:`StageForward` (shared by its virtual engines).
        grammar: the matchers' compiler on the rank that samples (the last stage's tensor-parallel
            rank 0; shared by its virtual engines), else ``None``.
    """

    def __init__(self, model, kv_cache, attention_backend, sampler, forward: StageForward,
                 grammar: GrammarCompiler | None = None, proposer: Proposer | None = None,
                 verify: Callable | None = None) -> None:
        super().__init__(model, kv_cache, attention_backend, sampler, forward=forward, grammar=grammar,
                         proposer=proposer, verify=verify)
        self.is_last = model.stage.is_last
        self._unsettled: set[SequenceId] = set()  # given lookahead slots last step: settled by its tokens

    def append_sampled(self, sampled: Sequence[SampledToken]) -> None:
        """Appends the last stage's tokens of this virtual engine's previous step to the sequences
        they belong to, its accepted drafts first, which count as computed; a sequence given
        lookahead slots then gives back the blocks past its computed ones (nothing to do on the last
        stage, which sampled them and settled at once)."""
        if self.is_last:
            return
        for token in sampled:
            state = self.requests.get(token.seq_id)
            if state is not None and token.sample_index == token.seq_id.sample_index:  # its own token
                state.token_ids += [*(a.token_id for a in token.accepted), token.token_id]
                state.num_computed_tokens += len(token.accepted)
        for seq_id in self._unsettled:
            if (state := self.requests.get(seq_id)) is not None:
                del state.block_ids[kept_blocks(state.num_computed_tokens, self.block_size):]
        self._unsettled.clear()

    def _settle(self, scheduled: Sequence[ScheduledRequest], sampled: Sequence[SampledToken]) -> None:
        """On the last stage as any runner; the others count the scheduled tokens now and the
        accepted drafts when the tokens come (:meth:`append_sampled`)."""
        if self.is_last:
            super()._settle(scheduled, sampled)
            return
        for s in scheduled:
            s.state.num_computed_tokens += s.num_scheduled_tokens
            if s.num_lookahead_tokens:
                self._unsettled.add(s.state.seq_id)

    def _run(self, scheduled: Sequence[ScheduledRequest]) -> tuple[list[SampledToken], list[PromptLogprobs]]:
        """Forward, and on the last stage logits and sampling; the other stages return nothing."""
        if self.is_last:
            return super()._run(scheduled)
        self._forward(sorted(scheduled, key=batch_order))
        return [], []
