"""The scheduler service's configuration (the engine's limits are ``pagedserve.engine.config``)."""

from __future__ import annotations

import argparse
import socket
from dataclasses import dataclass, field

from pagedserve.engine.config import Placement, PreemptionMode, SchedulerConfig, SchedulingPolicy
from services.common.auth import MISSING_CLUSTER_TOKEN, add_cluster_token_arguments, cluster_token_from_args
from services.common.metrics import add_metrics_port_argument, check_metrics_port
from services.common.service_args import (add_listen_arguments, add_redis_argument, default_advertise_host,
                                          redis_url_from_args)


@dataclass(frozen=True)
class SchedulerServiceConfig:
    """Settings of the scheduler process.

    Attributes:
        redis_url: Redis with the request stream and worker registrations (may hold a password:
            print it with ``redact_url``).
        cluster_token: secret every caller of the Scheduler service must send, and this scheduler
            sends to workers.
        host, port: where the Scheduler gRPC service listens.
        advertise_host: the host name gateways use to reach this scheduler (registered in Redis).
        consumer_name: this scheduler's id, and its name in the Redis consumer group; unique per
            scheduler, and kept across restarts so that its unfinished requests are resumed by it
            (a peer resumes them anyway once its lease expired).
        lease_ttl_s: time to live of this scheduler's lease and of its leases on workers, seconds:
            a scheduler that stops renewing is taken over this long after its last renewal.
        migration_limit: most times one request may move between schedulers; beyond it the
            request fails with UNAVAILABLE.
        policy: per-iteration limits.
        step_timeout_s: longest a worker may take for one iteration before the step counts as
            failed (the worker is reset and admitted again), seconds.
        worker_poll_interval_s: how often registrations are re-read from Redis, seconds.
        worker_gone_after_s: how long a worker's registration may be missing (a Redis restart)
            before the worker counts as gone, seconds.
        no_worker_timeout_s: while no worker has been up for this long, waiting requests fail
            with UNAVAILABLE (and new ones at once), seconds.
        gateway_grace_s: how long a gateway's requests survive its output stream being closed
            (long enough for it to reconnect), seconds.
        metrics_port: where ``/metrics`` is served on ``host`` (0: a free port, logged); None: nowhere.

    Raises:
        ValueError: a value out of range, or no cluster token.
    """

    redis_url: str = field(repr=False)
    cluster_token: str = field(repr=False)
    host: str = "127.0.0.1"
    port: int = 50052
    advertise_host: str = "127.0.0.1"
    consumer_name: str = "scheduler-0"
    lease_ttl_s: float = 3.0
    migration_limit: int = 3
    policy: SchedulerConfig = SchedulerConfig()
    step_timeout_s: float = 120.0
    worker_poll_interval_s: float = 0.5
    worker_gone_after_s: float = 5.0
    no_worker_timeout_s: float = 30.0
    gateway_grace_s: float = 10.0
    metrics_port: int | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        check_metrics_port(self.metrics_port)
        if not self.consumer_name or ":" in self.consumer_name or len(self.consumer_name) > 128:
            raise ValueError(f"--consumer-name must be 1-128 characters without ':', got {self.consumer_name!r}")
        if min(self.step_timeout_s, self.worker_poll_interval_s, self.worker_gone_after_s,
               self.no_worker_timeout_s, self.gateway_grace_s) <= 0:
            raise ValueError("timeouts and intervals must be positive")
        if self.lease_ttl_s < 3 * self.worker_poll_interval_s:
            raise ValueError(f"--lease-ttl must be at least {3 * self.worker_poll_interval_s:g} s (three renewals), "
                             f"got {self.lease_ttl_s:g}")
        if self.migration_limit < 0:
            raise ValueError(f"--migration-limit must be >= 0, got {self.migration_limit}")
        if not self.cluster_token:
            raise ValueError(MISSING_CLUSTER_TOKEN)


def add_scheduler_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the scheduler's flags to ``parser``."""
    add_redis_argument(parser)
    add_cluster_token_arguments(parser)
    add_listen_arguments(parser, default_port=50052)
    add_metrics_port_argument(parser)
    add_policy_arguments(parser)
    parser.add_argument(
        "--consumer-name", default="",
        help="this scheduler's id and its name in the Redis consumer group: unique per scheduler, kept across "
        "restarts (default: the host name, which is unique per container or pod)",
    )
    parser.add_argument(
        "--advertise-host", default="",
        help="host name gateways use to reach this scheduler (default: --host, or this machine's address "
        "when listening on all interfaces)",
    )
    parser.add_argument(
        "--lease-ttl", type=float, default=3.0,
        help="seconds a scheduler's lease (and its leases on workers) lasts without renewal: a scheduler "
        "that dies is taken over this long after its last renewal (default %(default)s)",
    )
    parser.add_argument(
        "--migration-limit", type=int, default=3,
        help="most times one request may move to another scheduler (after a scheduler died or gave it up); "
        "beyond it the request fails with UNAVAILABLE (default %(default)s)",
    )
    parser.add_argument(
        "--step-timeout", type=float, default=120.0,
        help="seconds a worker may take for one iteration before the step counts as failed; the worker "
        "is then reset and admitted again, its sequences recomputed (default %(default)s)",
    )
    parser.add_argument(
        "--no-worker-timeout", type=float, default=30.0,
        help="seconds requests wait while no worker is up before failing with UNAVAILABLE (default %(default)s)",
    )


def add_policy_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of SchedulerConfig (also used by `pagedserve up` and the offline engine)."""
    defaults = SchedulerConfig()
    parser.add_argument("--block-size", type=int, default=defaults.block_size,
                        help="token slots per KV block; workers must use the same (default %(default)s)")
    parser.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs,
                        help="most sequences running on one worker at once (default %(default)s)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=defaults.max_num_batched_tokens,
                        help="token budget of one iteration on one worker: decodes first, then prefill "
                        "chunks; 256 suits CPU workers, 2048 GPU ones (default %(default)s)")
    parser.add_argument("--no-chunked-prefill", action="store_true",
                        help="prefill each prompt whole in one iteration (prompts longer than the budget are refused)")
    parser.add_argument("--no-prefix-caching", action="store_true",
                        help="do not share cached prompt blocks between requests")
    parser.add_argument("--preemption-mode", choices=[m.value for m in PreemptionMode], default=defaults.preemption_mode.value,
                        help="how to take blocks back when they run out (default %(default)s); swap needs "
                        "workers with --swap-space")
    parser.add_argument("--scheduling-policy", choices=[p.value for p in SchedulingPolicy], default=defaults.policy.value,
                        help="fcfs, or priority (lower request priority runs first) (default %(default)s)")
    parser.add_argument("--max-plans-in-flight", type=int, default=defaults.max_plans_in_flight,
                        help="plans a worker may have been sent before it answers: 2 makes the next plan "
                        "while the model runs the current one (overlap scheduling), 1 makes it after the "
                        "answer; outputs are the same (default %(default)s)")
    parser.add_argument("--max-decode-slowdown", type=float, default=defaults.max_decode_slowdown,
                        help="a step that runs decodes may take at most this many times as long as the decodes "
                        "alone (predicted from the worker's step times); prefill chunks beside them are sized to "
                        "fit, so a long prompt does not stall running streams; inf: chunks fill the token budget "
                        "(default %(default)s)")
    parser.add_argument("--placement", choices=[p.value for p in Placement], default=defaults.placement.value,
                        help="where a new request runs: prefix (the scheduler, then the worker, holding most of its "
                        "prompt's prefix in cache, balanced against queues, KV usage and running sequences) or "
                        "least-loaded (the most free KV blocks; no forwarding between schedulers) (default %(default)s)")


def policy_from_args(args: argparse.Namespace) -> SchedulerConfig:
    return SchedulerConfig(
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_chunked_prefill=not args.no_chunked_prefill,
        enable_prefix_caching=not args.no_prefix_caching,
        preemption_mode=args.preemption_mode,
        policy=args.scheduling_policy,
        max_plans_in_flight=args.max_plans_in_flight,
        placement=args.placement,
        max_decode_slowdown=args.max_decode_slowdown,
    )


def policy_to_args(config: SchedulerConfig) -> list[str]:
    """The flags that ``policy_from_args`` reads back into ``config`` (for launching a scheduler)."""
    args = ["--block-size", str(config.block_size), "--max-num-seqs", str(config.max_num_seqs),
            "--max-num-batched-tokens", str(config.max_num_batched_tokens),
            "--preemption-mode", config.preemption_mode.value, "--scheduling-policy", config.policy.value,
            "--max-plans-in-flight", str(config.max_plans_in_flight), "--placement", config.placement.value,
            "--max-decode-slowdown", repr(config.max_decode_slowdown)]
    if not config.enable_chunked_prefill:
        args.append("--no-chunked-prefill")
    if not config.enable_prefix_caching:
        args.append("--no-prefix-caching")
    return args


def scheduler_config_from_args(args: argparse.Namespace) -> SchedulerServiceConfig:
    """Builds the config from parsed flags.

    Raises:
        ValueError: a value out of range, or no cluster token.
        OSError: a secret file cannot be read.
    """
    return SchedulerServiceConfig(
        redis_url=redis_url_from_args(args),
        cluster_token=cluster_token_from_args(args),
        host=args.host,
        port=args.port,
        advertise_host=args.advertise_host or default_advertise_host(args.host),
        consumer_name=args.consumer_name or socket.gethostname(),
        lease_ttl_s=args.lease_ttl,
        migration_limit=args.migration_limit,
        policy=policy_from_args(args),
        step_timeout_s=args.step_timeout,
        no_worker_timeout_s=args.no_worker_timeout,
        metrics_port=args.metrics_port,
    )
