"""Test helpers for tensor parallelism: the same forward steps run by a TP group or by one model."""

from __future__ import annotations

from pathlib import Path

import torch

from pagedserve.engine.attention import make_attention_backend
from tests.worker.tiny_models import forward_step, make_cache

BLOCK = 4
# Two steps over three sequences: a ragged prefill (5, 9, 3 tokens), then one decode token each.
PREFILL = [[5, 17, 33, 2, 90], [1, 2, 3, 4, 5, 6, 7, 8, 9], [60, 61, 62]]
DECODE = [[11], [12], [13]]
TABLES = [[7, 2], [0, 5, 9], [3]]


def two_steps(model) -> list[torch.Tensor]:
    """Logits ``[T, V]`` of the prefill step and of the decode step (same block tables)."""
    cache = make_cache(model, 12, BLOCK)
    backend = make_attention_backend("torch", "cpu")
    prefill = forward_step(model, cache, backend, PREFILL, [0, 0, 0], TABLES)
    decode = forward_step(model, cache, backend, DECODE, [len(p) for p in PREFILL], TABLES)
    return [prefill, decode]


def rank_main(rank: int, folder: str, init_method: str, world_size: int, out: str) -> None:
    """One rank: builds its shard, runs :func:`two_steps`; rank 0 saves the logits to ``out``."""
    from pagedserve.engine.parallel.group import GroupSpec, TensorParallelGroup
    from pagedserve.engine.parallel.rank import load_model_shard

    torch.set_num_threads(1)
    group = TensorParallelGroup(GroupSpec(init_method, world_size, timeout_s=30.0), rank)
    try:
        model = load_model_shard(folder, group, torch.float32, "cpu")
        logits = two_steps(model)
        if rank == 0:
            torch.save(logits, Path(out))
    finally:
        group.close()


def grid_rank_main(rank: int, folder: str, init_method: str, sizes: tuple[int, int], out: str) -> None:
    """One rank of a ``T x P`` grid: builds its runner, runs the :func:`two_steps` forwards through its
    stage; the last stage's tensor-parallel rank 0 saves the logits to ``out``."""
    from pagedserve.engine.parallel.group import GroupSpec, TensorParallelGroup
    from pagedserve.engine.parallel.rank import RankConfig, build_stage_runners

    torch.set_num_threads(1)
    t, p = sizes
    group = TensorParallelGroup(GroupSpec(init_method, t * p, timeout_s=30.0), rank)
    try:
        runner = build_stage_runners(RankConfig(folder, 1 << 20, BLOCK, pipeline_parallel_size=p), group)[0]
        backend = make_attention_backend("torch", "cpu")
        steps = [(PREFILL, [0, 0, 0]), (DECODE, [len(q) for q in PREFILL])]
        # forward_step computes logits on every stage; only the last stage's are the model's.
        logits = [forward_step(runner.model, runner.kv_cache, backend, ids, ctx, TABLES, forward=runner.forward)
                  for ids, ctx in steps]
        if rank == (p - 1) * t:  # the last stage's tensor-parallel rank 0
            torch.save(logits, Path(out))
    finally:
        group.close()
