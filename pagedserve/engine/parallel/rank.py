"""One rank of a tensor-parallel worker: its model shard, its KV cache, and how it samples.

Every rank runs the same :class:`~pagedserve.engine.model_runner.ModelRunner` over the same
BatchPlans, so the request states and block tables stay equal on all ranks; only the weights and
the KV cache (this rank's heads) differ. Sampling happens on rank 0 only, over the full logits
(gathered on every rank by the LM head's all-gather); rank 0 broadcasts the sampler's output so
the other ranks append the same tokens to their states. Speculative decoding goes the same way:
rank 0 drafts (n-gram, or a whole draft model with its own cache beside rank 0's shard; every rank
sizes its cache for both, so the block counts agree) and broadcasts the draft ids, every rank runs
the drafts' rows, and rank 0 verifies and broadcasts what was accepted.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
from torch import nn

from pagedserve.engine.attention import make_attention_backend
from pagedserve.engine.grammar_matchers import grammar_compiler_for
from pagedserve.engine.config import DEFAULT_BLOCK_SIZE, GemmBackend, KVCacheDtype
from pagedserve.engine.forward_batch import ForwardBatch
from pagedserve.engine.kv_cache import (KVCache, KVCacheSpec, cache_dtype, context_shortfall, num_blocks_for_memory,
                                       num_cpu_blocks_for_memory, sized_cache)
from pagedserve.engine.messages import BatchPlan, SampledToken
from pagedserve.engine.model_runner import ModelRunner
from pagedserve.engine.models.registry import load_model_config, model_class_for
from pagedserve.engine.parallel.group import Collectives, CollectiveError, TensorParallelGroup
from pagedserve.engine.parallel.pipeline import RankPosition, StageForward, StageRunner, pipeline_stage
from pagedserve.engine.parallel.sharding import ShardingError, shard_layout
from pagedserve.engine.parallel.stage_drafts import StageDrafts, draft_seed
from pagedserve.engine.runner_config import DEFAULT_KV_CACHE_MEMORY, RunnerConfig
from pagedserve.engine.runner_factory import resolve_dtype
from pagedserve.engine.sampler import Sampler, SamplerOutput
from pagedserve.engine.spec_decode.config import SpeculativeConfig, SpeculativeMethod
from pagedserve.engine.spec_decode.draft_model import build_proposer, build_proposers, speculative_caches
from pagedserve.engine.spec_decode.proposer import Proposal, Proposer
from pagedserve.engine.spec_decode.verifier import Drafted, verify
from pagedserve.engine.worker_requests import ScheduledRequest

log = logging.getLogger("pagedserve.worker")

T = TypeVar("T")


@dataclass(frozen=True)
class RankConfig:
    """What every rank needs to build its runner (picklable: sent to the helper processes).

    Attributes:
        model_path: Hugging Face folder (``config.json``, ``*.safetensors``).
        kv_cache_memory_bytes: KV-cache bytes of each rank (so the worker's capacity grows with T).
        block_size, dtype (a torch dtype name), device, attention_backend, kv_cache_dtype: as
            ``build_model_runner``.
        swap_space_bytes: CPU swap bytes per rank.
        sampler_seed: seed of rank 0's sampler.
        num_threads: torch intra-op threads of a helper rank (0: leave torch's default).
        pipeline_parallel_size: pipeline stages P (``parallel/pipeline.py``); the group's
            ``world_size`` is ``T * P``.
        num_virtual_engines: with P > 1, the worker's virtual engines (``parallel/pipeline_runner.py``),
            each with its own sequences and ``1/num_virtual_engines`` of every rank's KV budget.
        speculative: speculative decoding (over pipeline stages the first stage drafts: ``stage_drafts.py``).
    """

    model_path: str
    kv_cache_memory_bytes: int = DEFAULT_KV_CACHE_MEMORY
    block_size: int = DEFAULT_BLOCK_SIZE
    dtype: str = "float32"
    device: str = "cpu"
    attention_backend: str = "auto"
    swap_space_bytes: int = 0
    sampler_seed: int | None = None
    num_threads: int = 0
    pipeline_parallel_size: int = 1
    num_virtual_engines: int = 1
    kv_cache_dtype: KVCacheDtype = KVCacheDtype.AUTO
    speculative: SpeculativeConfig = SpeculativeConfig()

    @classmethod
    def of(cls, model_path: str | Path, runner: RunnerConfig, block_size: int, speculative: SpeculativeConfig,
           num_threads: int = 0) -> RankConfig:
        """The ranks' config of a worker run with ``runner``'s settings: the one place that maps RunnerConfig's
        fields onto RankConfig (the worker service and the offline engine build theirs here)."""
        return cls(str(model_path), runner.kv_cache_memory or DEFAULT_KV_CACHE_MEMORY, block_size,
                   resolve_dtype(runner.dtype, runner.device), runner.device, runner.attention_backend,
                   runner.swap_space, num_threads=num_threads, pipeline_parallel_size=runner.pipeline_parallel_size,
                   num_virtual_engines=runner.num_virtual_engines, kv_cache_dtype=runner.kv_cache_dtype,
                   speculative=speculative)


def check_shardable(model_path: str | Path, world_size: int, pipeline_parallel_size: int = 1) -> None:
    """Raises :class:`ShardingError` if the folder's model cannot run over ``world_size``
    tensor-parallel ranks, or :class:`PipelineError` over ``pipeline_parallel_size`` stages (both
    say which sizes work). Every model class built on ``ShardedCausalLM`` splits (all registered ones)."""
    from pagedserve.engine.models.sharded import ShardedCausalLM

    config = load_model_config(model_path)
    if (world_size > 1 or pipeline_parallel_size > 1) and not issubclass(model_class_for(config.architecture),
                                                                          ShardedCausalLM):
        raise ShardingError(f"{config.architecture} cannot be split over ranks; "
                            "run it with tensor_parallel_size=pipeline_parallel_size=1")
    shard_layout(config, 0, world_size)
    pipeline_stage(config.num_layers, 0, pipeline_parallel_size)


def load_model_shard(model_path: str | Path, group: TensorParallelGroup, dtype: torch.dtype,
                     device: str) -> nn.Module:
    """Builds this rank's shard of the folder's model and fills it slice by slice
    (``model.rank_checkpoint``: peak = the shard plus one slice)."""
    check_shardable(model_path, group.world_size)
    config = load_model_config(model_path)
    model = model_class_for(config.architecture)(config, dtype=dtype, device=device, parallel=group)
    model.load_checkpoint(model.rank_checkpoint(model_path))
    return model.eval()


class LeaderSampler:
    """Rank 0's sampler: samples, then broadcasts the :class:`SamplerOutput` (or the error) to the ranks."""

    def __init__(self, sampler: Sampler, group: Collectives) -> None:
        self.sampler = sampler
        self.group = group

    def __call__(self, logits: torch.Tensor, params: Sequence, counts: Sequence[int], histories: Sequence,
                 matchers: Sequence | None = None):
        """``logits`` float32 ``[N, vocab]`` -> the wrapped sampler's output, shared with every rank."""
        return _shared(self.group, lambda: self.sampler(logits, params, counts, histories, matchers))

    def verify(self, logits: torch.Tensor, drafted: Sequence[Drafted]) -> list[SampledToken]:
        """``verifier.verify`` with the wrapped sampler; its answer shared with every rank."""
        return _shared(self.group, lambda: verify(self.sampler, logits, drafted))


class FollowerSampler:
    """A helper rank's sampler: receives rank 0's :class:`SamplerOutput` (re-raises rank 0's error)."""

    def __init__(self, group: Collectives) -> None:
        self.group = group

    def __call__(self, logits: torch.Tensor, params: Sequence, counts: Sequence[int],
                 histories: Sequence, matchers: Sequence | None = None) -> SamplerOutput:
        return _received(self.group, "sampler")

    def verify(self, logits: torch.Tensor, drafted: Sequence[Drafted]) -> list[SampledToken]:
        """Rank 0's verification of the same drafts (``LeaderSampler.verify``)."""
        return _received(self.group, "verifier")


class LeaderProposer:
    """Rank 0's proposer: drafts with ``proposer`` (drawing from ``sampler``, rank 0's own: the
    runner's ``LeaderSampler`` would broadcast) and shares the draft ids with every rank."""

    def __init__(self, proposer: Proposer, sampler: Sampler, group: Collectives) -> None:
        self.proposer = proposer
        self.sampler = sampler
        self.group = group

    def propose(self, requests: Sequence[ScheduledRequest], sampler: object) -> list[Proposal]:
        """The wrapped proposer's proposals (``sampler``, the runner's, unused); their ids (or its
        error) shared with every rank."""
        proposals: list[Proposal] = []

        def draft_ids() -> list[tuple[int, ...]]:
            proposals.extend(self.proposer.propose(requests, self.sampler))
            return [p.token_ids for p in proposals]

        _shared(self.group, draft_ids)
        return proposals

    def observe(self, batch: ForwardBatch) -> None:
        self.proposer.observe(batch)

    def move_blocks(self, plan: BatchPlan) -> None:
        self.proposer.move_blocks(plan)


class FollowerProposer:
    """A helper rank's proposer: rank 0's drafts (``LeaderProposer``); no cache of its own."""

    def __init__(self, group: Collectives) -> None:
        self.group = group

    def propose(self, requests: Sequence[ScheduledRequest], sampler: object) -> list[Proposal]:
        return [Proposal(ids) for ids in _received(self.group, "proposer")]

    def observe(self, batch: ForwardBatch) -> None:
        """Nothing: rank 0 drafts."""

    def move_blocks(self, plan: BatchPlan) -> None:
        """Nothing: rank 0 holds the draft's cache."""


def _shared(group: Collectives, compute: Callable[[], T]) -> T:
    """``compute()``'s result, broadcast from rank 0 to every rank; its error is broadcast instead
    (a follower raises it as :class:`CollectiveError`, see :func:`_received`) and raised here."""
    try:
        out = compute()
    except Exception as exc:
        group.broadcast_object(exc)
        raise
    return group.broadcast_object(out)


def _received(group: Collectives, what: str):
    """What rank 0 broadcasts next; raises :class:`CollectiveError` when it sends its ``what``'s error."""
    out = group.broadcast_object(None)
    if isinstance(out, Exception):
        raise CollectiveError(f"rank 0's {what} failed: {out}")
    return out


def build_rank_runner(config: RankConfig, group: TensorParallelGroup) -> ModelRunner:
    """This tensor-parallel rank's ModelRunner: its model shard, a KV cache sized for its KV heads
    from ``config.kv_cache_memory_bytes``, and the leader or follower sampler (pipeline stages:
    :func:`build_stage_runners`).

    Raises:
        ShardingError, WeightLoadError, ModelConfigError: the model cannot be sharded or loaded.
        ValueError: the budget holds no block.
    """
    dtype = getattr(torch, config.dtype)
    kv_dtype = cache_dtype(config.kv_cache_dtype, dtype)
    backend = make_attention_backend(config.attention_backend, config.device)
    model = load_model_shard(config.model_path, group, dtype, config.device)
    c = model.config  # this rank's heads
    spec = KVCacheSpec(c.num_layers, c.num_kv_heads, c.head_dim, config.block_size, kv_dtype)
    beside = speculative_caches(config.speculative, spec)
    kv_cache = sized_cache(spec, config.kv_cache_memory_bytes, config.swap_space_bytes, config.device, *beside)
    speculates = config.speculative.method is not SpeculativeMethod.NONE
    if group.rank == 0:  # only the rank that samples holds grammar matchers (and drafts)
        if (shortfall := context_shortfall(spec, kv_cache.num_blocks, c.max_model_len, *beside)) is not None:
            log.warning(shortfall)  # every rank has as many blocks
        sampler = Sampler(seed=config.sampler_seed, device=config.device)
        leader = LeaderSampler(sampler, group)
        proposer = build_proposer(config.speculative, model, GemmBackend.TORCH, kv_cache, backend)
        return ModelRunner(model, kv_cache, backend, leader, grammar=grammar_compiler_for(config.model_path),
                           proposer=LeaderProposer(proposer, sampler, group) if speculates else None,
                           verify=leader.verify)
    follower = FollowerSampler(group)
    return ModelRunner(model, kv_cache, backend, follower, proposer=FollowerProposer(group) if speculates else None,
                       verify=follower.verify)


def build_stage_runners(config: RankConfig, world: TensorParallelGroup) -> list[StageRunner]:
    """A pipeline rank's runners, one per virtual engine: they share the stage's layers (its
    tensor-parallel shard of them when T > 1) and each has a KV cache of those layers only, from
    ``kv_cache_memory_bytes / num_virtual_engines`` (blocks counted for the largest stage, so every
    rank has as many); the last stage samples (the leader on its tensor-parallel rank 0).

    Raises:
        ShardingError, PipelineError, WeightLoadError: the model cannot be split or loaded.
        ValueError: a virtual engine's budget holds no block.
    """
    position = RankPosition(world.rank, world.world_size // config.pipeline_parallel_size,
                            config.pipeline_parallel_size)
    tp = world.subgroups(position.stage_ranks()) if position.tensor_parallel_size > 1 else None
    full = load_model_config(config.model_path)
    check_shardable(config.model_path, position.tensor_parallel_size, position.pipeline_parallel_size)
    stage = pipeline_stage(full.num_layers, position.stage, position.pipeline_parallel_size)
    dtype = getattr(torch, config.dtype)
    kv_dtype = cache_dtype(config.kv_cache_dtype, dtype)
    model = model_class_for(full.architecture)(full, dtype=dtype, device=config.device, parallel=tp, stage=stage)
    model.load_checkpoint(model.rank_checkpoint(config.model_path))
    model.eval()
    c = model.config
    sized = KVCacheSpec(stage.max_stage_layers, c.num_kv_heads, c.head_dim, config.block_size, kv_dtype)
    spec = KVCacheSpec(stage.num_layers, c.num_kv_heads, c.head_dim, config.block_size, kv_dtype)
    engines = config.num_virtual_engines
    beside = speculative_caches(config.speculative, spec)  # the first stage's draft cache: every stage counts it
    num_blocks = num_blocks_for_memory(sized, config.kv_cache_memory_bytes // engines, *beside)
    num_cpu_blocks = num_cpu_blocks_for_memory(sized, config.swap_space_bytes // engines, *beside)
    caches = [KVCache(spec, num_blocks, device=config.device, num_cpu_blocks=num_cpu_blocks) for _ in range(engines)]
    # a stage before the last samples nothing: its sampler only draws drafts, from uniforms apart from the verifier's
    raw_sampler = Sampler(seed=config.sampler_seed if stage.is_last else draft_seed(config.sampler_seed),
                          device=config.device)
    sampler = raw_sampler
    if tp is not None:
        sampler = LeaderSampler(raw_sampler, tp) if tp.rank == 0 else FollowerSampler(tp)
    backend = make_attention_backend(config.attention_backend, config.device)
    forward = StageForward(model, position, world)
    samples = stage.is_last and (tp is None or tp.rank == 0)  # only the rank that samples holds matchers
    shortfall = context_shortfall(sized, num_blocks, c.max_model_len, *beside, num_caches=engines)
    if samples and shortfall is not None:  # said once, by the sampling rank
        log.warning(shortfall)
    grammar = grammar_compiler_for(config.model_path) if samples else None
    proposers = _stage_proposers(config.speculative, model, caches, backend, forward, tp, raw_sampler)
    verify = sampler.verify if tp is not None else None
    return [StageRunner(model, cache, backend, sampler, forward, grammar, proposer, verify)
            for cache, proposer in zip(caches, proposers)]


def _stage_proposers(speculative: SpeculativeConfig, model: nn.Module, caches: Sequence[KVCache], backend,
                     links: StageForward, tp: Collectives | None, sampler: Sampler) -> list[StageDrafts | None]:
    """Per virtual engine, the rank's :class:`StageDrafts` (``None`` without speculation): on the first
    stage around the engine's proposer (n-gram, or the draft model loaded once: on its tensor-parallel
    rank 0, which shares the ids with the stage's other ranks)."""
    if speculative.method is SpeculativeMethod.NONE:
        return [None] * len(caches)
    if not links.stage.is_first:
        inner: list[Proposer | None] = [None] * len(caches)
    elif tp is not None and tp.rank > 0:
        inner = [FollowerProposer(tp) for _ in caches]
    else:
        inner = build_proposers(speculative, model, GemmBackend.TORCH, caches, backend)
        if tp is not None:
            inner = [LeaderProposer(p, sampler, tp) for p in inner]
    return [StageDrafts(p, links, links.stage.is_last, model.config.vocab_size) for p in inner]
