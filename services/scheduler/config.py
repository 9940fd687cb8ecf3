"""The scheduler's policy settings, and the stats it reports."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from services.common.service_args import add_listen_arguments, add_redis_argument


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one iteration on one worker.

    Attributes:
        block_size: token slots per KV-cache block; every worker must use the same.
        max_num_seqs: most sequences running on one worker at once.
        max_num_batched_tokens: most tokens (prefill chunks + decodes) one worker computes in one
            iteration. Prompts longer than this are prefilled in chunks over several iterations.

    Raises:
        ValueError: a non-positive limit, or a token budget smaller than ``max_num_seqs`` (every
            running sequence must be able to decode in the same iteration).
    """

    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                f"max_num_seqs ({self.max_num_seqs})"
            )


@dataclass(frozen=True)
class WorkerStats:
    """KV-cache occupancy of one worker, in blocks."""

    worker_id: str
    num_blocks: int
    num_free_blocks: int
    num_running: int


@dataclass(frozen=True)
class SchedulerStats:
    """A snapshot of the scheduler's queues."""

    num_waiting: int
    num_running: int
    num_preemptions: int
    num_steps: int
    workers: tuple[WorkerStats, ...]


@dataclass(frozen=True)
class SchedulerServiceConfig:
    """Settings of the scheduler process.

    Attributes:
        redis_url: Redis with the request stream and worker registrations.
        host, port: where the Scheduler gRPC service listens.
        consumer_name: this scheduler's name in the Redis consumer group; keep it across restarts
            so that unfinished requests are picked up again.
        policy: per-iteration limits.
        step_timeout_s: longest a worker may take for one iteration before it counts as failed.
        worker_poll_interval_s: how often registrations are re-read from Redis.
        gateway_grace_s: how long a gateway's requests survive its output stream being closed
            (long enough for it to reconnect), seconds.

    Raises:
        ValueError: a value out of range.
    """

    redis_url: str
    host: str = "0.0.0.0"
    port: int = 50052
    consumer_name: str = "scheduler-0"
    policy: SchedulerConfig = SchedulerConfig()
    step_timeout_s: float = 120.0
    worker_poll_interval_s: float = 0.5
    gateway_grace_s: float = 10.0

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if not self.consumer_name:
            raise ValueError("--consumer-name must not be empty")
        if min(self.step_timeout_s, self.worker_poll_interval_s, self.gateway_grace_s) <= 0:
            raise ValueError("timeouts and intervals must be positive")


def add_scheduler_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the scheduler's flags to ``parser``."""
    add_redis_argument(parser)
    add_listen_arguments(parser, default_port=50052)
    add_policy_arguments(parser)
    parser.add_argument(
        "--consumer-name", default="scheduler-0",
        help="name in the Redis consumer group; keep it across restarts to resume unfinished requests "
        "(default %(default)s)",
    )
    parser.add_argument(
        "--step-timeout", type=float, default=120.0,
        help="seconds a worker may take for one iteration before it counts as failed (default %(default)s)",
    )


def add_policy_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of SchedulerConfig (also used by `pagedserve up` and the offline engine)."""
    defaults = SchedulerConfig()
    parser.add_argument("--block-size", type=int, default=defaults.block_size,
                        help="token slots per KV block; workers must use the same (default %(default)s)")
    parser.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs,
                        help="most sequences running on one worker at once (default %(default)s)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=defaults.max_num_batched_tokens,
                        help="token budget of one iteration on one worker; longer prompts are prefilled "
                        "in chunks (default %(default)s)")


def policy_from_args(args: argparse.Namespace) -> SchedulerConfig:
    return SchedulerConfig(
        block_size=args.block_size, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens
    )


def scheduler_config_from_args(args: argparse.Namespace) -> SchedulerServiceConfig:
    return SchedulerServiceConfig(
        redis_url=args.redis_url,
        host=args.host,
        port=args.port,
        consumer_name=args.consumer_name,
        policy=policy_from_args(args),
        step_timeout_s=args.step_timeout,
    )
