"""A tensor- and/or pipeline-parallel worker: rank 0 in this process, ranks 1..T*P-1 in spawned
helpers (the grid layout: ``parallel/pipeline.py``), or some of them on other machines, dialing in
(``parallel/rank_link.py``).

Rank 0 receives each BatchPlan (from the engine, or from the scheduler through a worker service),
wakes the helpers through a pipe (so an idle worker does not hit the collectives' timeout), then
hands the plan to every rank with ``broadcast_object``; all ranks apply it and run the forward,
rank 0 samples and answers with the StepResult. A helper that dies makes rank 0's next collective
raise :class:`CollectiveError` (gloo: at once on a closed connection, else after ``timeout_s``);
the runner is then broken and every later step raises too.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
from collections.abc import Callable
from concurrent.futures import Future
from multiprocessing.connection import Connection

import torch

from pagedserve.engine.config import CompileMode, GemmBackend
from pagedserve.engine.messages import BatchPlan, StepResult
from pagedserve.engine.model_runner import ModelRunner, PlanMismatchError
from pagedserve.engine.parallel.group import COLLECTIVE_TIMEOUT_S, CollectiveError, GroupSpec, TensorParallelGroup
from pagedserve.engine.parallel.pipeline_runner import start_pipeline_parallel_runner
from pagedserve.engine.parallel.rank import RankConfig, build_rank_runner
from pagedserve.engine.parallel.rank_link import LOCAL, RankPlacement
from pagedserve.engine.parallel.spawn import STOP, launch_ranks, stop_helpers
from pagedserve.engine.structured_output import StructuredOutput

_STEP = "step"

log = logging.getLogger("pagedserve.worker")


def check_rank_kernels(gemm_backend: GemmBackend, compile_mode: CompileMode) -> None:
    """Ranks build their shards with torch's own GEMMs in eager mode (oneDNN packing and inductor are
    not wired into the sharded layers): ``auto`` runs them, logged; ``onednn``, ``panels`` or ``inductor``
    is refused.

    Raises:
        ValueError: ``gemm_backend`` is ``onednn`` or ``panels``, or ``compile_mode`` is ``inductor``.
    """
    if gemm_backend in (GemmBackend.ONEDNN, GemmBackend.PANELS) or compile_mode is not CompileMode.EAGER:
        raise ValueError("tensor_parallel_size or pipeline_parallel_size > 1 runs eager torch GEMMs only: "
                         "use gemm_backend 'auto' or 'torch' and compile_mode 'eager'")
    if gemm_backend is GemmBackend.AUTO:
        log.info("--gemm-backend auto: torch GEMMs (F.linear) on tensor- and pipeline-parallel ranks")


def helper_main(config: RankConfig, spec: GroupSpec, rank: int, conn: Connection) -> None:
    """Entry point of helper rank ``rank``: join the group, load the shard, then run every plan
    rank 0 broadcasts until it says stop (or its pipe closes: rank 0 is gone)."""
    if config.num_threads > 0:
        torch.set_num_threads(config.num_threads)
    conn.send("started")  # imports done: joining now fits in the rendezvous timeout
    group = TensorParallelGroup(spec, rank)
    try:
        runner = build_rank_runner(config, group)
        conn.send("ready")
        while True:
            try:
                command = conn.recv()
            except (EOFError, OSError):  # rank 0 is gone
                return
            if command == STOP:
                return
            plan = group.broadcast_object(None)
            try:
                runner.execute(plan)
            except PlanMismatchError:
                continue  # rank 0 raises the same error to its caller
    finally:
        group.close()


class TensorParallelRunner:
    """Rank 0 of a tensor-parallel worker, with the ``ModelRunner`` interface the engine uses.

    Args:
        runner: rank 0's own runner (its shard, its KV cache, the leader sampler).
        group: the group rank 0 belongs to.
        helpers: ``(process, pipe)`` of ranks 1..T-1.
    """

    def __init__(self, runner: ModelRunner, group: TensorParallelGroup,
                 helpers: list[tuple[mp.Process, Connection]]) -> None:
        self.runner = runner
        self.group = group
        self.helpers = helpers
        self.broken: str | None = None
        self.on_failure: Callable[[], None] | None = None  # e.g. a worker service stopping itself

    @property
    def tensor_parallel_size(self) -> int:
        return self.group.world_size

    @property
    def num_blocks(self) -> int:
        return self.runner.num_blocks

    @property
    def num_cpu_blocks(self) -> int:
        return self.runner.num_cpu_blocks

    @property
    def block_size(self) -> int:
        return self.runner.block_size

    def prepare(self, structure: StructuredOutput) -> Future[None]:
        """Rank 0 builds the grammar (the rank that samples: ``ModelRunner.prepare``)."""
        return self.runner.prepare(structure)

    def execute(self, plan: BatchPlan) -> StepResult:
        """Hands ``plan`` to every rank and runs it; the StepResult is rank 0's.

        Raises:
            CollectiveError: a rank died or stopped answering (now or in an earlier step).
            PlanMismatchError: as ``ModelRunner.execute`` (every rank refuses the plan alike).
        """
        if self.broken:
            raise CollectiveError(f"the tensor-parallel worker failed earlier: {self.broken}")
        try:
            for process, conn in self.helpers:
                if not process.is_alive():
                    raise CollectiveError(f"helper rank {process.name} exited with code {process.exitcode}")
                conn.send(_STEP)
            self.group.broadcast_object(plan)
            return self.runner.execute(plan)
        except (CollectiveError, BrokenPipeError, OSError) as exc:
            self.broken = str(exc)
            if self.on_failure is not None:
                self.on_failure()
            raise CollectiveError(str(exc)) from exc

    def close(self) -> None:
        """Stops the helpers and leaves the group; idempotent."""
        stop_helpers(self.helpers)
        self.helpers = []
        self.group.close()


def start_tensor_parallel_runner(config: RankConfig, tensor_parallel_size: int, timeout_s: float = COLLECTIVE_TIMEOUT_S,
                                 placement: RankPlacement = LOCAL):
    """Spawns ranks 1..T*P-1 (P: ``config.pipeline_parallel_size``; with ``placement``, only those
    up to its local ranks: it waits for the others to dial in), joins them as rank 0 and loads every
    shard: a :class:`TensorParallelRunner` when P is 1, else a
    :class:`~pagedserve.engine.parallel.pipeline_runner.PipelineParallelRunner`.

    Args:
        config: the runner settings every rank uses (``num_threads`` 0: ``cpu_count // (T*P)`` per helper).
        tensor_parallel_size: the tensor-parallel size T (>= 1).
        timeout_s: the collectives' timeout (how long a silent rank is waited for).
        placement: where the ranks live (``parallel/rank_link.py``); default all on this machine.

    Raises:
        ShardingError, PipelineError: the model cannot be split over T ranks or P stages (checked
            before spawning).
        ValueError: an invalid placement.
        CollectiveError: a helper failed to start, or remote ranks did not join in time.
    """
    if config.pipeline_parallel_size > 1:
        return start_pipeline_parallel_runner(config, tensor_parallel_size, timeout_s, placement)
    group, helpers, runner = launch_ranks(config, tensor_parallel_size, timeout_s, helper_main, build_rank_runner,
                                          placement)
    return TensorParallelRunner(runner, group, helpers)


