"""The worker service's configuration, validated at start and never changed."""

from __future__ import annotations

import argparse
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from services.common.auth import MISSING_CLUSTER_TOKEN, add_cluster_token_arguments, cluster_token_from_args
from services.common.metrics import add_metrics_port_argument, check_metrics_port
from services.common.service_args import (
    add_listen_arguments, add_model_argument, add_redis_argument, default_advertise_host, env_default,
    redis_url_from_args,
)
from pagedserve.engine.config import (ATTENTION_BACKENDS, CompileMode, GemmBackend, add_compile_mode_argument,
                                      add_gemm_backend_argument, add_rank_grid_arguments)
from pagedserve.units import parse_bytes, parse_cpu_list

DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class WorkerConfig:
    """Settings of one worker process.

    Attributes:
        model: model folder.
        redis_url: where to register (may hold a password: print it with ``redact_url``).
        cluster_token: secret the scheduler must send with every Execute.
        host, port: where the Worker gRPC service listens (port 0 picks a free one).
        advertise_host: the host name the scheduler uses to reach this worker.
        worker_id: unique id of this worker process.
        kv_cache_memory: bytes of K and V cache to allocate; ``None``: 1 GiB on CPU, on CUDA what
            ``gpu_memory_utilization`` leaves after the weights.
        block_size: token slots per KV block (must equal the scheduler's).
        dtype: weights and KV-cache dtype; ``auto`` is bfloat16 on CUDA, float32 elsewhere.
        device: ``cpu`` or ``cuda``.
        attention_backend: ``auto`` (Triton on CUDA, the C++ op on CPU), ``cpu``, ``torch`` or ``triton``.
        gemm_backend: linear-layer kernels on CPU (see :class:`~pagedserve.engine.config.GemmBackend`).
        compile_mode: eager, or the dense part compiled by inductor before the worker registers
            (see :class:`~pagedserve.engine.config.CompileMode`).
        gpu_memory_utilization: on CUDA, the share of the GPU's memory the worker may use in all.
        swap_space: bytes of CPU memory for blocks swapped out by swap preemption (0: none).
        num_threads: torch intra-op threads; 0 keeps torch's default.
        tensor_parallel_size: ranks that split the model (every architecture, CPU): this process is
            rank 0 and talks to the scheduler, T-1 helper processes hold the other shards;
            ``kv_cache_memory`` is per rank, so the registered KV capacity grows with T.
        pipeline_parallel_size: pipeline stages (consecutive layers each, same models as TP): the
            worker has ``T * P`` ranks; each rank's KV cache holds its stage's layers only, so the
            registered KV capacity grows with P.
        virtual_engines: with P > 1, virtual engines V (0: P), each served on its own port
            (``port + i`` when a port is given) and registered as worker ``<worker_id>/ve<i>`` with
            ``1/V`` of each rank's KV budget; each runs its plans one at a time, overlapping the
            others in the stages.
        rank_address: ``HOST:PORT`` where rank 0 waits for the ranks it does not spawn (``pagedserve
            worker-rank``, authenticated with the cluster token; the gloo rendezvous at ``PORT+1``); "": none.
        local_ranks: ranks ``0..K-1`` spawned on this machine (0: all ``T*P``); the others dial ``rank_address``.
        rank_join_timeout_s: seconds rank 0 waits for the remote ranks before failing at start.
        cpu_affinity: CPU cores this worker runs on, its OpenMP threads bound one per core (on a
            shared machine, give each worker its own cores); empty: no binding.
        heartbeat_interval_s: how often the registration is refreshed, seconds.
        metrics_port: where ``/metrics`` is served on ``host`` (0: a free port, logged); None: nowhere.

    Raises:
        ValueError: a value out of range, or no cluster token.
    """

    model: Path
    redis_url: str = field(repr=False)
    cluster_token: str = field(repr=False)
    host: str = "127.0.0.1"
    port: int = 0
    advertise_host: str = "127.0.0.1"
    worker_id: str = "worker-0"
    kv_cache_memory: int | None = None
    block_size: int = 16
    dtype: str = "auto"
    device: str = "cpu"
    attention_backend: str = "auto"
    gemm_backend: GemmBackend = GemmBackend.TORCH
    compile_mode: CompileMode = CompileMode.EAGER
    gpu_memory_utilization: float = 0.9
    swap_space: int = 0
    num_threads: int = 0
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    virtual_engines: int = 0
    rank_address: str = ""
    local_ranks: int = 0
    rank_join_timeout_s: float = 300.0
    cpu_affinity: tuple[int, ...] = ()
    heartbeat_interval_s: float = 1.0
    metrics_port: int | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        check_metrics_port(self.metrics_port)
        if self.block_size < 1:
            raise ValueError(f"--block-size must be positive, got {self.block_size}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {DTYPES}, got {self.dtype!r}")
        object.__setattr__(self, "gemm_backend", GemmBackend(self.gemm_backend))
        object.__setattr__(self, "compile_mode", CompileMode(self.compile_mode))
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"--attention-backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.num_threads < 0:
            raise ValueError(f"--num-threads must be >= 0, got {self.num_threads}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"--tensor-parallel-size must be >= 1, got {self.tensor_parallel_size}")
        if self.pipeline_parallel_size < 1:
            raise ValueError(f"--pipeline-parallel-size must be >= 1, got {self.pipeline_parallel_size}")
        if self.virtual_engines < 0 or (self.virtual_engines > 1 and self.pipeline_parallel_size == 1):
            raise ValueError(f"--virtual-engines must be 0 (one per pipeline stage), 1, or more with "
                             f"--pipeline-parallel-size > 1; got {self.virtual_engines}")
        if self.local_ranks or self.rank_address:
            from pagedserve.engine.parallel.rank_link import RankPlacement

            RankPlacement(self.rank_address, self.local_ranks, self.cluster_token.encode()).spawned(
                self.tensor_parallel_size * self.pipeline_parallel_size)
        if self.heartbeat_interval_s <= 0:
            raise ValueError("heartbeat interval must be positive")
        if not self.cluster_token:
            raise ValueError(MISSING_CLUSTER_TOKEN)


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the worker's flags to ``parser``."""
    add_model_argument(parser)
    add_redis_argument(parser)
    add_cluster_token_arguments(parser)
    add_listen_arguments(parser, default_port=0)
    add_metrics_port_argument(parser)
    parser.add_argument(
        "--advertise-host",
        default=env_default("PAGEDSERVE_ADVERTISE_HOST", ""),
        help="address the scheduler dials to reach this worker (env PAGEDSERVE_ADVERTISE_HOST; "
        "default: --host, or this machine's address when --host listens on all interfaces)",
    )
    parser.add_argument("--worker-id", default="", help="unique worker id (default: worker-<random>)")
    parser.add_argument(
        "--kv-cache-memory",
        default=env_default("PAGEDSERVE_KV_CACHE_MEMORY", ""),
        help="memory for the KV cache, e.g. 2GiB or 512MiB (env PAGEDSERVE_KV_CACHE_MEMORY; default: 1GiB on "
        "CPU, on CUDA what --gpu-memory-utilization leaves after the weights)",
    )
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                        help="CUDA: share of the GPU's memory the worker may use (default %(default)s)")
    parser.add_argument("--swap-space", default="0",
                        help="CPU memory for swapped-out KV blocks (scheduler --preemption-mode swap), e.g. 4GiB "
                        "(default: none)")
    parser.add_argument("--block-size", type=int, default=16, help="token slots per KV block (default %(default)s)")
    parser.add_argument("--dtype", choices=DTYPES, default="auto",
                        help="weights and KV dtype; auto: bfloat16 on CUDA, float32 on CPU (default %(default)s)")
    parser.add_argument("--device", default="cpu", help="torch device: cpu or cuda (default %(default)s)")
    parser.add_argument(
        "--attention-backend", choices=ATTENTION_BACKENDS, default="auto",
        help="auto: Triton on CUDA; on CPU the compiled C++ op for decodes (cpu), or plain torch if it cannot be built (default %(default)s)",
    )
    add_gemm_backend_argument(parser)
    add_compile_mode_argument(parser)
    parser.add_argument("--num-threads", type=int, default=0, help="torch CPU threads; 0 = torch's default")
    add_rank_grid_arguments(parser)
    parser.add_argument("--rank-address", default="", metavar="HOST:PORT",
                        help="with --local-ranks K < T*P: listen here for ranks K..T*P-1, started on other machines "
                        "with `pagedserve worker-rank --rank R --rank-address HOST:PORT` and the cluster token; "
                        "the gloo rendezvous is at PORT+1 (default: every rank on this machine)")
    parser.add_argument("--local-ranks", type=int, default=0, metavar="K",
                        help="ranks 0..K-1 run on this machine, the others dial --rank-address (default: all T*P)")
    parser.add_argument("--rank-join-timeout", type=float, default=300.0, metavar="SECONDS",
                        help="how long rank 0 waits for the remote ranks to join before failing (default %(default)s)")
    parser.add_argument(
        "--cpu-affinity", default="",
        help="run on these CPU cores (e.g. 0-3) with torch's OpenMP threads bound to them; give each worker "
        "on a machine its own cores (default: no binding)",
    )


def worker_config_from_args(args: argparse.Namespace, model: Path) -> WorkerConfig:
    """Builds the config from parsed flags; ``model`` is the resolved model folder.

    Raises:
        ValueError: a value out of range, or no cluster token.
        OSError: a secret file cannot be read.
    """
    advertise = args.advertise_host or default_advertise_host(args.host)
    return WorkerConfig(
        model=model,
        redis_url=redis_url_from_args(args),
        cluster_token=cluster_token_from_args(args),
        host=args.host,
        port=args.port,
        advertise_host=advertise,
        worker_id=args.worker_id or f"worker-{uuid.uuid4().hex[:8]}",
        kv_cache_memory=parse_bytes(args.kv_cache_memory) if args.kv_cache_memory else None,
        block_size=args.block_size,
        dtype=args.dtype,
        device=args.device,
        attention_backend=args.attention_backend,
        gemm_backend=GemmBackend(args.gemm_backend),
        compile_mode=CompileMode(args.compile_mode),
        gpu_memory_utilization=args.gpu_memory_utilization,
        swap_space=parse_bytes(args.swap_space) if args.swap_space not in ("", "0") else 0,
        num_threads=args.num_threads,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        virtual_engines=args.virtual_engines,
        rank_address=args.rank_address,
        local_ranks=args.local_ranks,
        rank_join_timeout_s=args.rank_join_timeout,
        cpu_affinity=parse_cpu_list(args.cpu_affinity) if args.cpu_affinity else (),
        metrics_port=args.metrics_port,
    )
