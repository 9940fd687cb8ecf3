"""One rank of a tensor-parallel worker: its model shard, its KV cache, and how it samples.

Every rank runs the same :class:`~pagedserve.engine.model_runner.ModelRunner` over the same
BatchPlans, so the request states and block tables stay equal on all ranks; only the weights and
the KV cache (this rank's heads) differ. Sampling happens on rank 0 only, over the full logits
(gathered on every rank by the LM head's all-gather); rank 0 broadcasts the sampler's output so
the other ranks append the same tokens to their states.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from pagedserve.engine.attention import make_attention_backend
from pagedserve.engine.kv_cache import KVCache, KVCacheSpec, num_blocks_for_memory
from pagedserve.engine.model_runner import ModelRunner
from pagedserve.engine.models import load_model_config, model_class_for
from pagedserve.engine.parallel.group import CollectiveError, TensorParallelGroup
from pagedserve.engine.parallel.sharding import ShardingError, iter_sharded_checkpoint, shard_layout
from pagedserve.engine.sampler import Sampler, SamplerOutput

TP_ARCHITECTURES = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"})


@dataclass(frozen=True)
class RankConfig:
    """What every rank needs to build its runner (picklable: sent to the helper processes).

    Attributes:
        model_path: Hugging Face folder (``config.json``, ``*.safetensors``).
        kv_cache_memory_bytes: KV-cache bytes of each rank (so the worker's capacity grows with T).
        block_size, dtype (a torch dtype name), device, attention_backend: as ``build_model_runner``.
        swap_space_bytes: CPU swap bytes per rank.
        sampler_seed: seed of rank 0's sampler.
        num_threads: torch intra-op threads of a helper rank (0: leave torch's default).
    """

    model_path: str
    kv_cache_memory_bytes: int = 1 << 30
    block_size: int = 16
    dtype: str = "float32"
    device: str = "cpu"
    attention_backend: str = "auto"
    swap_space_bytes: int = 0
    sampler_seed: int | None = None
    num_threads: int = 0


def check_shardable(model_path: str | Path, world_size: int) -> None:
    """Raises :class:`ShardingError` if the folder's model cannot run over ``world_size`` ranks."""
    config = load_model_config(model_path)
    if config.architecture not in TP_ARCHITECTURES:
        raise ShardingError(f"tensor parallelism supports {', '.join(sorted(TP_ARCHITECTURES))}, "
                            f"not {config.architecture}")
    shard_layout(config, 0, world_size)


def load_model_shard(model_path: str | Path, group: TensorParallelGroup, dtype: torch.dtype,
                     device: str) -> nn.Module:
    """Builds this rank's shard of the folder's model and fills it slice by slice
    (``iter_sharded_checkpoint``: peak = the shard plus one slice)."""
    check_shardable(model_path, group.world_size)
    config = load_model_config(model_path)
    model = model_class_for(config.architecture)(config, dtype=dtype, device=device, parallel=group)
    model.load_checkpoint(iter_sharded_checkpoint(model_path, model.shard))
    return model.eval()


class LeaderSampler:
    """Rank 0's sampler: samples, then broadcasts the :class:`SamplerOutput` (or the error) to the ranks."""

    def __init__(self, sampler: Sampler, group: TensorParallelGroup) -> None:
        self.sampler = sampler
        self.group = group

    def __call__(self, logits: torch.Tensor, params: Sequence, counts: Sequence[int], histories: Sequence):
        """``logits`` float32 ``[N, vocab]`` -> the wrapped sampler's output, shared with every rank."""
        try:
            out = self.sampler(logits, params, counts, histories)
        except Exception as exc:
            self.group.broadcast_object(exc)
            raise
        return self.group.broadcast_object(out)


class FollowerSampler:
    """A helper rank's sampler: receives rank 0's :class:`SamplerOutput` (re-raises rank 0's error)."""

    def __init__(self, group: TensorParallelGroup) -> None:
        self.group = group

    def __call__(self, logits: torch.Tensor, params: Sequence, counts: Sequence[int],
                 histories: Sequence) -> SamplerOutput:
        out = self.group.broadcast_object(None)
        if isinstance(out, Exception):
            raise CollectiveError(f"rank 0's sampler failed: {out}")
        return out


def build_rank_runner(config: RankConfig, group: TensorParallelGroup) -> ModelRunner:
    """This rank's ModelRunner: its model shard, a KV cache sized for its KV heads from
    ``config.kv_cache_memory_bytes``, and the leader or follower sampler.

    Raises:
        ShardingError, WeightLoadError, ModelConfigError: the model cannot be sharded or loaded.
        ValueError: the budget holds no block.
    """
    dtype = getattr(torch, config.dtype)
    backend = make_attention_backend(config.attention_backend, config.device)
    model = load_model_shard(config.model_path, group, dtype, config.device)
    c = model.config  # this rank's heads
    spec = KVCacheSpec(c.num_layers, c.num_kv_heads, c.head_dim, config.block_size, dtype)
    kv_cache = KVCache(spec, num_blocks_for_memory(spec, config.kv_cache_memory_bytes), device=config.device,
                       num_cpu_blocks=config.swap_space_bytes // spec.bytes_per_block)
    sampler = (LeaderSampler(Sampler(seed=config.sampler_seed, device=config.device), group)
               if group.rank == 0 else FollowerSampler(group))
    return ModelRunner(model, kv_cache, backend, sampler)
