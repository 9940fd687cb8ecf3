"""The gateway service's configuration, validated at start and never changed."""

from __future__ import annotations

import argparse
import uuid
from dataclasses import dataclass
from pathlib import Path

from services.common.service_args import add_listen_arguments, add_model_argument, add_redis_argument, env_default


@dataclass(frozen=True)
class GatewayConfig:
    """Settings of one gateway process.

    Attributes:
        model: model folder (for its tokenizer, chat template, context length and EOS ids).
        redis_url: where requests are queued.
        scheduler_address: host:port of the Scheduler service (token events, aborts).
        host, port: where the Generation service listens.
        gateway_id: unique id of this gateway; the scheduler routes tokens by it.
        max_concurrent_requests: requests in flight above which new ones get RESOURCE_EXHAUSTED.

    Raises:
        ValueError: a value out of range.
    """

    model: Path
    redis_url: str
    scheduler_address: str
    host: str = "0.0.0.0"
    port: int = 50051
    gateway_id: str = "gateway-0"
    max_concurrent_requests: int = 1024

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if ":" not in self.scheduler_address:
            raise ValueError(f"--scheduler must be HOST:PORT, got {self.scheduler_address!r}")
        if self.max_concurrent_requests < 1:
            raise ValueError(f"--max-concurrent-requests must be positive, got {self.max_concurrent_requests}")


def add_gateway_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the gateway's flags to ``parser``."""
    add_model_argument(parser)
    add_redis_argument(parser)
    add_listen_arguments(parser, default_port=50051)
    parser.add_argument(
        "--scheduler",
        default=env_default("PAGEDSERVE_SCHEDULER", "127.0.0.1:50052"),
        help="HOST:PORT of the scheduler service (env PAGEDSERVE_SCHEDULER; default %(default)s)",
    )
    parser.add_argument("--gateway-id", default="", help="unique gateway id (default: gateway-<random>)")
    parser.add_argument(
        "--max-concurrent-requests", type=int, default=1024,
        help="requests in flight before new ones are refused with RESOURCE_EXHAUSTED (default %(default)s)",
    )


def gateway_config_from_args(args: argparse.Namespace, model: Path) -> GatewayConfig:
    """Builds the config from parsed flags; ``model`` is the resolved model folder."""
    return GatewayConfig(
        model=model,
        redis_url=args.redis_url,
        scheduler_address=args.scheduler,
        host=args.host,
        port=args.port,
        gateway_id=args.gateway_id or f"gateway-{uuid.uuid4().hex[:8]}",
        max_concurrent_requests=args.max_concurrent_requests,
    )
