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

import multiprocessing as mp
import time
from collections.abc import Callable
from typing import Any
from dataclasses import replace
from multiprocessing.connection import Connection

import torch

from pagedserve.engine.messages import BatchPlan, StepResult
from pagedserve.engine.model_runner import ModelRunner, PlanMismatchError
from pagedserve.engine.parallel.group import CollectiveError, GroupSpec, TensorParallelGroup, free_loopback_port
from pagedserve.engine.parallel.rank import RankConfig, build_rank_runner, check_shardable
from pagedserve.engine.parallel.rank_link import LOCAL, RankPlacement, accept_ranks, send_setup

_STEP, _STOP = "step", "stop"
STARTUP_TIMEOUT_S = 300.0  # helpers importing torch and loading their shard


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
            if command == _STOP:
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


def stop_helpers(helpers: list[tuple[mp.Process, Connection]]) -> None:
    """Tells each helper rank to stop, waits up to 10 s for it, then kills it."""
    for process, conn in helpers:
        try:
            conn.send(_STOP)
        except OSError:
            pass
        process.join(timeout=10)
        if process.is_alive():
            process.kill()


def wait_ready(helpers: list[tuple[mp.Process, Connection]], timeout_s: float) -> None:
    """Waits for one message of every helper ("started", then "ready" once its shard is loaded);
    raises if one exits first or the time runs out."""
    deadline = time.monotonic() + timeout_s
    for process, conn in helpers:
        while not conn.poll(0.2):
            if not process.is_alive():
                raise CollectiveError(f"helper rank {process.name} exited with code {process.exitcode} while starting")
            if time.monotonic() > deadline:
                raise CollectiveError(f"helper rank {process.name} not ready after {timeout_s} s")
        conn.recv()


def start_tensor_parallel_runner(config: RankConfig, tensor_parallel_size: int, timeout_s: float = 5.0,
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
        from pagedserve.engine.parallel.pipeline_runner import start_pipeline_parallel_runner

        return start_pipeline_parallel_runner(config, tensor_parallel_size, timeout_s, placement)
    group, helpers, runner = launch_ranks(config, tensor_parallel_size, timeout_s, helper_main, build_rank_runner,
                                          placement)
    return TensorParallelRunner(runner, group, helpers)


def launch_ranks(config: RankConfig, tensor_parallel_size: int, timeout_s: float,
                 target: Callable[[RankConfig, GroupSpec, int, Connection], None],
                 build: Callable[[RankConfig, TensorParallelGroup], Any],
                 placement: RankPlacement = LOCAL) -> tuple[TensorParallelGroup, list, Any]:
    """Waits for the remote ranks of ``placement`` to dial in (none by default), spawns the local
    helper ranks running ``target(config, spec, rank, pipe)``, hands the remote ones their setup (they
    run the same ``target``), joins them all as rank 0, builds rank 0's runner(s) with
    ``build(config, group)`` and waits for every helper's "ready".

    Returns:
        ``(group, [(process or RemoteRank, connection)] of ranks 1.., what build returned)``.

    Raises:
        ShardingError, PipelineError: checked before spawning. ValueError: an invalid placement.
        CollectiveError: a helper failed to start; remote ranks did not join in time.
    """
    check_shardable(config.model_path, tensor_parallel_size, config.pipeline_parallel_size)
    world_size = tensor_parallel_size * config.pipeline_parallel_size
    local = placement.spawned(world_size)
    if config.num_threads == 0:
        config = replace(config, num_threads=max(1, (mp.cpu_count() or 1) // local))
    spec = GroupSpec(placement.rendezvous(f"tcp://127.0.0.1:{free_loopback_port()}"), world_size, timeout_s)
    remotes = accept_ranks(placement, range(local, world_size)) if local < world_size else []
    helpers, group = [], None
    try:
        helpers = spawn_helpers(config, spec, range(1, local), target)
        wait_ready(helpers, STARTUP_TIMEOUT_S)  # "started": local imports done
        send_setup(remotes, config, spec)
        helpers += remotes
        wait_ready(remotes, STARTUP_TIMEOUT_S)
        group = TensorParallelGroup(spec, 0)
        built = build(config, group)
        wait_ready(helpers, STARTUP_TIMEOUT_S)
    except BaseException:
        for process, _ in helpers + remotes:
            process.kill()
        if group is not None:
            group.close()
        raise
    return group, helpers, built


def spawn_helpers(config: RankConfig, spec: GroupSpec, ranks: range,
                  target: Callable[[RankConfig, GroupSpec, int, Connection], None]) -> list[tuple[mp.Process, Connection]]:
    """Starts ``target(config, spec, rank, pipe)`` in a spawned process per rank; ``[(process, pipe)]``."""
    context = mp.get_context("spawn")
    helpers = []
    for rank in ranks:
        ours, theirs = context.Pipe()
        process = context.Process(target=target, args=(config, spec, rank, theirs), name=f"rank-{rank}", daemon=True)
        process.start()
        helpers.append((process, ours))
    return helpers
