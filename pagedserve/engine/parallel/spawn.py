"""Starting, readying and stopping the helper rank processes of a parallel worker.

Rank 0 starts its local helpers (forked from multiprocessing's fork server, torch imported), hands remote ranks their
setup (``rank_link.py``), and waits for each helper's two messages: "started" (its imports are done,
so joining the group now fits in the rendezvous timeout) and "ready" (its shard is loaded). A
helper's loop ends on :data:`STOP` (or when its pipe closes). Used by the tensor-parallel runner
(``launch.py``) and the pipeline-parallel one (``pipeline_runner.py``) alike.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Callable
from dataclasses import replace
from multiprocessing.connection import Connection
from typing import Any

from pagedserve.engine.openmp_threads import release_openmp_team
from pagedserve.engine.parallel.group import CollectiveError, GroupSpec, TensorParallelGroup, serve_rendezvous
from pagedserve.engine.parallel.rank import RankConfig, check_shardable
from pagedserve.engine.parallel.rank_link import LOCAL, RankPlacement, accept_ranks, send_setup

STOP = "stop"  # rank 0 -> helper: leave the loop
STARTUP_TIMEOUT_S = 300.0  # helpers importing torch and loading their shard


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
    spec, store = serve_rendezvous(GroupSpec(placement.rendezvous("tcp://127.0.0.1:0"), world_size, timeout_s))
    remotes = accept_ranks(placement, range(local, world_size)) if local < world_size else []
    helpers, group = [], None
    try:
        helpers = spawn_helpers(config, spec, range(1, local), target)
        wait_ready(helpers, STARTUP_TIMEOUT_S)  # "started": local imports done
        send_setup(remotes, config, spec)
        helpers += remotes
        wait_ready(remotes, STARTUP_TIMEOUT_S)
        group = TensorParallelGroup(spec, 0, store)
        built = build(config, group)
        release_openmp_team()  # rank 0 runs on its worker's model thread (openmp_threads.py)
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
    """Starts ``target(config, spec, rank, pipe)`` in a new process per rank; ``[(process, pipe)]``.

    The processes are forked from multiprocessing's fork server, which imports ``target``'s module
    (torch and the engine) once, before any OpenMP team or CUDA context exists (numpy's OpenBLAS
    pool, which handles fork, is its one other thread): a helper then starts without importing torch
    again (with ``spawn`` each did: 3-4 CPU-s a helper on the AVX2 EPYC). The server starts at this
    process's first call and keeps that moment's environment and CPU affinity for every later helper
    (the worker service binds its cores before; an in-process engine that changes ``os.environ``
    between two parallel engines gives the second one's helpers the first one's environment).
    """
    context = mp.get_context("forkserver")
    context.set_forkserver_preload([target.__module__])  # read when the server starts (first use only)
    helpers = []
    for rank in ranks:
        ours, theirs = context.Pipe()
        process = context.Process(target=target, args=(config, spec, rank, theirs), name=f"rank-{rank}", daemon=True)
        process.start()
        helpers.append((process, ours))
    return helpers


def stop_helpers(helpers: list[tuple[mp.Process, Connection]]) -> None:
    """Tells each helper rank to stop, waits up to 10 s for it, then kills it."""
    for process, conn in helpers:
        try:
            conn.send(STOP)
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
