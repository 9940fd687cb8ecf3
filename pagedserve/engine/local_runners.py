"""The model runners of an in-process engine (``pagedserve.llm.LLM``), by worker id."""

from __future__ import annotations

from pathlib import Path

from pagedserve.engine.runner_config import EngineConfig


def build_local_runners(path: Path, config: EngineConfig, rank_placement=None) -> dict:
    """``config.num_workers`` workers' runners over the model folder ``path``, by worker id
    (``worker-<i>``, or ``worker-0/ve<v>`` for virtual engines).

    Args:
        rank_placement: with T*P > 1, a :class:`~pagedserve.engine.parallel.rank_link.RankPlacement`
            whose remote ranks (``pagedserve worker-rank``) rank 0 waits for; None: all spawned here.

    Raises:
        ValueError: T*P > 1 with several workers or with other kernels than eager torch GEMMs
            (``check_rank_kernels``), and the runners' own errors.
    """
    from pagedserve.engine.runner_factory import build_configured_runner

    runner = config.runner
    if runner.ranks > 1:
        return _parallel_runners(path, config, rank_placement)
    return {
        f"worker-{i}": build_configured_runner(path, runner, config.scheduler.block_size, config.speculative_config)
        for i in range(config.num_workers)
    }


def _parallel_runners(path: Path, config: EngineConfig, rank_placement=None) -> dict:
    """One worker of T*P ranks, rank 0 here plus T*P-1 helper processes (or remote ranks); with
    P > 1, its virtual engines (worker ids ``worker-0/ve<v>`` when there are several)."""
    from pagedserve.engine.parallel.launch import check_rank_kernels, start_tensor_parallel_runner
    from pagedserve.engine.parallel.rank import RankConfig
    from pagedserve.engine.parallel.rank_link import LOCAL

    runner = config.runner
    check_rank_kernels(runner.gemm_backend, runner.compile_mode)
    if config.num_workers > 1:  # rank 0 of each worker would need its own torch.distributed default group
        raise ValueError("tensor_parallel_size or pipeline_parallel_size > 1 takes one worker per process "
                         "(num_workers=1)")
    ranks = RankConfig.of(path, runner, config.scheduler.block_size, config.speculative_config)
    leader = start_tensor_parallel_runner(ranks, runner.tensor_parallel_size, placement=rank_placement or LOCAL)
    if runner.pipeline_parallel_size == 1:
        return {"worker-0": leader}
    views = leader.virtual_engines()
    return {"worker-0": views[0]} if len(views) == 1 else {f"worker-0/ve{i}": v for i, v in enumerate(views)}
