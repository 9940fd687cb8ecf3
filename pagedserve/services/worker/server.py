"""Runs one worker process: load the model, serve Worker.Execute, register in Redis."""

from __future__ import annotations

import logging
import os
import threading
import uuid
from concurrent import futures

import grpc

from pagedserve.services.common import telemetry
from pagedserve.services.common.auth import CLUSTER_TOKEN_KEY, MetadataAuthInterceptor
from pagedserve.services.common.grpc_server import INTERNAL_SERVER_OPTIONS, add_health, bind, set_serving
from pagedserve.services.common.metrics import serve_metrics
from pagedserve.services.common.pb import engine_pb2 as pb
from pagedserve.services.common.pb import engine_pb2_grpc
from pagedserve.services.common.redis_wait import connect_redis
from pagedserve.services.worker.config import WorkerConfig
from pagedserve.services.worker.metrics import WorkerMetrics
from pagedserve.services.worker.registration import WorkerRegistrar
from pagedserve.services.worker.service import WorkerServicer

log = logging.getLogger("pagedserve.worker")


def bind_to_cores(cores: tuple[int, ...]) -> None:
    """Runs every thread of this process on ``cores``: the threads it has (numpy's OpenBLAS pool,
    started by imports) and, by inheritance, those it starts later (torch's OpenMP team, gRPC's;
    the helper ranks of a tensor-parallel worker too). ``serve_worker`` sizes torch's team to the
    cores unless ``--num-threads`` is given.

    OpenMP threads are not bound one per core: libgomp reads ``OMP_PROC_BIND``/``OMP_PLACES`` when
    torch loads, before this runs (setting them here did nothing, and a forkserver's helper ranks
    inherited them); set before, they bind the first thread to the first core and every thread
    started later (gRPC's, the model thread) inherits that one core. Binding a team one per core
    measured no faster in-process (docs/benchmarks.md, "What was tried").

    Raises:
        OSError: a core is not one this process may run on.
    """
    pinned: set[str] = set()
    while unpinned := set(os.listdir("/proc/self/task")) - pinned:  # again, for threads started meanwhile
        for thread_id in unpinned:
            try:
                os.sched_setaffinity(int(thread_id), cores)
            except ProcessLookupError:  # the thread ended meanwhile
                pass
        pinned |= unpinned


def serve_worker(config: WorkerConfig, stop: threading.Event) -> None:
    """Serves until ``stop`` is set, then unregisters and shuts down. A pipeline-parallel worker with
    V virtual engines serves each on its own port and registers it as worker ``<id>/ve<i>``.

    Raises:
        ConnectionError: Redis did not answer at start.
        OSError: the port cannot be bound.
    """
    if config.cpu_affinity:
        bind_to_cores(config.cpu_affinity)
    import torch

    from pagedserve.engine.runner_factory import build_configured_runner

    tracer = telemetry.setup_tracing("pagedserve-worker")
    threads = config.num_threads or len(config.cpu_affinity)  # torch's default counts every core of the machine
    if threads:
        torch.set_num_threads(threads)
    ranks = config.runner.tensor_parallel_size * config.runner.pipeline_parallel_size
    runners = _build_runners(config) if ranks > 1 else {config.worker_id: build_configured_runner(
        config.model, config.runner, config.block_size, config.speculative_config)}
    runner = next(iter(runners.values()))
    if hasattr(runner, "on_failure"):  # a tensor/pipeline-parallel worker whose rank died cannot recover: stop
        runner.on_failure = stop.set
    metrics = WorkerMetrics(config.model.name, config.worker_id)
    metrics_server = serve_metrics(metrics.registry, config.host, config.metrics_port, f"worker {config.worker_id}")
    redis_client = connect_redis(config.redis_url, stop)
    served = [_serve_runner(config, worker_id, each, index, tracer, metrics, redis_client)
              for index, (worker_id, each) in enumerate(runners.items())]
    stop.wait()
    for server, health, registrar in served:
        set_serving(health, False)
        registrar.stop()
        server.stop(grace=2).wait()
    if metrics_server is not None:
        metrics_server.stop()
    telemetry.shutdown_tracing()
    if hasattr(runner, "close"):  # a tensor-parallel worker's helper ranks
        runner.close()
        if runner.broken:  # exit non-zero so that a supervisor (`pagedserve up`) restarts the worker
            raise SystemExit(f"worker {config.worker_id}: a tensor-parallel rank failed: {runner.broken}")


def _serve_runner(config: WorkerConfig, worker_id: str, runner, index: int, tracer, metrics: WorkerMetrics,
                  redis_client) -> tuple[grpc.Server, object, WorkerRegistrar]:
    """Serves Worker.Execute for one runner (the worker, or one of its virtual engines: port
    ``config.port + index`` when a port is given) and registers it as ``worker_id``."""
    auth = MetadataAuthInterceptor(CLUSTER_TOKEN_KEY, config.cluster_token, "cluster token")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), interceptors=[auth], options=INTERNAL_SERVER_OPTIONS)
    engine_pb2_grpc.add_WorkerServicer_to_server(WorkerServicer(runner, tracer, metrics), server)
    health = add_health(server)
    port = bind(server, config.host, config.port + index if config.port else 0)
    server.start()
    registration = pb.WorkerRegistration(
        worker_id=worker_id,
        address=f"{config.advertise_host}:{port}",
        num_blocks=runner.num_blocks,
        block_size=config.block_size,
        model=config.model.name,
        num_cpu_blocks=runner.num_cpu_blocks,
        instance_id=uuid.uuid4().hex,
        num_speculative_tokens=config.speculative_config.num_lookahead_tokens,
        device=config.runner.device,
    )
    registrar = WorkerRegistrar(redis_client, registration, config.heartbeat_interval_s, config.cluster_token)
    registrar.start()
    set_serving(health, True)
    import torch

    log.info("worker %s serving %s at %s with %d KV blocks on %d threads", worker_id, config.model.name,
             registration.address, runner.num_blocks, torch.get_num_threads())
    return server, health, registrar


def _build_runners(config: WorkerConfig) -> dict:
    """Rank 0 of a tensor- and/or pipeline-parallel worker (``pagedserve.engine.parallel.launch``;
    helpers spawned here, or dialing ``--rank-address``), by worker id: the worker itself, or its
    virtual engines ``<id>/ve<i>``."""
    from pagedserve.engine.parallel.launch import check_rank_kernels, start_tensor_parallel_runner
    from pagedserve.engine.parallel.rank import RankConfig
    from pagedserve.engine.parallel.rank_link import RankPlacement

    if config.runner.device != "cpu":
        raise ValueError("--tensor-parallel-size or --pipeline-parallel-size > 1 runs on the CPU only (gloo; NCCL later)")
    check_rank_kernels(config.runner.gemm_backend, config.runner.compile_mode)
    import torch

    ranks = config.runner.tensor_parallel_size * config.runner.pipeline_parallel_size
    local = config.local_ranks or ranks
    threads = max(1, (config.num_threads or torch.get_num_threads()) // local)
    torch.set_num_threads(threads)  # the worker's threads are shared among its ranks on this machine
    rank = RankConfig.of(config.model, config.runner, config.block_size, config.speculative_config, num_threads=threads)
    placement = RankPlacement(config.rank_address, config.local_ranks, config.cluster_token.encode(),
                              config.rank_join_timeout_s)
    runner = start_tensor_parallel_runner(rank, config.runner.tensor_parallel_size, placement=placement)
    if config.runner.pipeline_parallel_size == 1:
        return {config.worker_id: runner}
    views = runner.virtual_engines()
    if len(views) == 1:
        return {config.worker_id: views[0]}
    return {f"{config.worker_id}/ve{i}": view for i, view in enumerate(views)}
