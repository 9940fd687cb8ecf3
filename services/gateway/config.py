"""The gateway service's configuration, validated at start and never changed."""

from __future__ import annotations

import argparse
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from services.common.auth import (
    MISSING_CLUSTER_TOKEN, add_cluster_token_arguments, cluster_token_from_args, read_secret,
)
from services.common.metrics import add_metrics_port_argument, check_metrics_port
from services.common.service_args import (
    add_listen_arguments, add_model_argument, add_redis_argument, env_default, redis_url_from_args,
)


MAX_SERVED_MODEL_NAME_CHARS = 256
"""Longest ``--served-model-name`` (the HTTP API bounds a request's ``model`` by it)."""

REDIS_CONNECTIONS_BESIDES_REQUESTS = 16
"""Pooled Redis connections beyond one per request in flight: the scheduler directory's polls, the
health check's PING, and the background deletes of abandoned requests' queue entries."""

SHUTDOWN_CLOSE_S = 5.0
"""Longest time, after ``--shutdown-grace-s``, that the gateway takes to end the calls left and exit,
seconds: a supervisor's grace period (docker-compose ``stop_grace_period``, Kubernetes
``terminationGracePeriodSeconds``) must be at least the two together."""


@dataclass(frozen=True)
class GatewayConfig:
    """Settings of one gateway process.

    Attributes:
        model: model folder (for its tokenizer, chat template, context length and EOS ids).
        redis_url: where requests are queued and the schedulers register (the gateway connects to
            every live one it finds there); may hold a password: print it with ``redact_url``.
        cluster_token: secret sent to the schedulers with every call; scheduler registrations not
            signed with it are ignored.
        host, port: where the Generation service listens.
        api_key: when not empty, every Generation call must carry ``authorization: Bearer API_KEY``.
        tls_cert_file, tls_key_file: PEM certificate chain and private key; when given, the gateway
            serves TLS only.
        gateway_id: unique id of this gateway; the schedulers route tokens by it.
        max_concurrent_requests: requests in flight above which new ones get RESOURCE_EXHAUSTED
            (HTTP 429).
        metrics_port: a separate port for ``/metrics`` on ``host`` (0: a free port, logged); None:
            none (the HTTP API serves ``GET /metrics`` in any case).
        http_port: where the OpenAI-compatible HTTP API listens (on ``host``; 0 picks a free port,
            which the gateway logs).
        served_model_name: the model name HTTP clients must send as ``model`` and ``/v1/models``
            lists ("" means the model folder's name, see ``model_name``).
        shutdown_grace_s: on SIGTERM or SIGINT the gateway drains: health turns NOT_SERVING, new
            requests are refused with UNAVAILABLE (HTTP 503), and the requests in flight may finish
            for this many seconds; those left then end with UNAVAILABLE and the process exits
            (within ``SHUTDOWN_CLOSE_S`` more).
        http_header_timeout_s: an HTTP connection must send a request's complete headers within
            this many seconds of opening (or of its first byte after a previous request), else it
            is closed (idle keep-alive connections close after ``http_server.KEEP_ALIVE_S``).

    Raises:
        ValueError: a value out of range, no cluster token, or only one of the TLS files.
    """

    model: Path
    redis_url: str = field(repr=False)
    cluster_token: str = field(repr=False)
    host: str = "127.0.0.1"
    port: int = 50051
    gateway_id: str = "gateway-0"
    max_concurrent_requests: int = 1024
    api_key: str = field(default="", repr=False)
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    metrics_port: int | None = None
    http_port: int = 8000
    served_model_name: str = ""
    shutdown_grace_s: float = 30.0
    http_header_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        check_metrics_port(self.metrics_port)
        if not 0 <= self.http_port < 65536:
            raise ValueError(f"--http-port must be in [0, 65535], got {self.http_port}")
        if self.http_port and self.http_port == self.port:
            raise ValueError(f"--http-port and --port must differ, both are {self.port}")
        if len(self.served_model_name) > MAX_SERVED_MODEL_NAME_CHARS:
            raise ValueError(f"--served-model-name holds more than {MAX_SERVED_MODEL_NAME_CHARS} characters")
        if self.max_concurrent_requests < 1:
            raise ValueError(f"--max-concurrent-requests must be positive, got {self.max_concurrent_requests}")
        if not 0 <= self.shutdown_grace_s <= 3600:
            raise ValueError(f"--shutdown-grace-s must be in [0, 3600], got {self.shutdown_grace_s}")
        if not 0 < self.http_header_timeout_s <= 3600:
            raise ValueError(f"--http-header-timeout-s must be in (0, 3600], got {self.http_header_timeout_s}")
        if not self.cluster_token:
            raise ValueError(MISSING_CLUSTER_TOKEN)
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("--tls-cert-file and --tls-key-file go together")

    @property
    def model_name(self) -> str:
        """The served model name: ``served_model_name``, else the model folder's name."""
        return self.served_model_name or self.model.name

    @property
    def redis_max_connections(self) -> int:
        """Size of the gateway's Redis pool: one connection per request in flight (each queues
        itself, and checks its queue entry while no scheduler has taken it) and a few more
        (``REDIS_CONNECTIONS_BESIDES_REQUESTS``)."""
        return self.max_concurrent_requests + REDIS_CONNECTIONS_BESIDES_REQUESTS


def add_gateway_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the gateway's flags to ``parser``."""
    add_model_argument(parser)
    add_redis_argument(parser)
    add_cluster_token_arguments(parser)
    add_listen_arguments(parser, default_port=50051)
    add_metrics_port_argument(parser)
    add_api_key_arguments(parser)
    parser.add_argument("--tls-cert-file", default="", help="PEM certificate (chain) to serve TLS with")
    parser.add_argument("--tls-key-file", default="", help="PEM private key of --tls-cert-file")
    parser.add_argument("--gateway-id", default="", help="unique gateway id (default: gateway-<random>)")
    parser.add_argument(
        "--max-concurrent-requests", type=int, default=1024,
        help="requests in flight before new ones are refused with RESOURCE_EXHAUSTED, HTTP 429 (default %(default)s)",
    )
    parser.add_argument(
        "--shutdown-grace-s", type=float, default=GatewayConfig.shutdown_grace_s,
        help="on SIGTERM, seconds the requests in flight may take to finish while new ones are refused; keep "
        f"the supervisor's grace period (Kubernetes terminationGracePeriodSeconds) {SHUTDOWN_CLOSE_S:g} s "
        "longer (default %(default)s)",
    )
    parser.add_argument(
        "--http-header-timeout-s", type=float, default=GatewayConfig.http_header_timeout_s,
        help="seconds an HTTP client has to send a request's complete headers before its connection is "
        "closed (default %(default)s)",
    )
    add_http_arguments(parser)


def add_http_arguments(parser: argparse.ArgumentParser) -> None:
    """``--http-port`` and ``--served-model-name``: the OpenAI-compatible HTTP API (gateway and `pagedserve up`)."""
    parser.add_argument(
        "--http-port", type=int, default=8000,
        help="port of the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models, /health, "
        "/tokenize, /detokenize) on the same --host; 0 picks a free one (default %(default)s)",
    )
    parser.add_argument(
        "--served-model-name", default="",
        help="model name HTTP clients send as `model` and /v1/models lists (default: the model folder's name)",
    )


def add_api_key_arguments(parser: argparse.ArgumentParser) -> None:
    """``--api-key`` (env PAGEDSERVE_API_KEY) and ``--api-key-file``: for the gateway and `pagedserve up`."""
    parser.add_argument(
        "--api-key", default=env_default("PAGEDSERVE_API_KEY", ""),
        help="clients must send `authorization: Bearer KEY` (env PAGEDSERVE_API_KEY; default: no key); on the "
        "command line it is visible in `ps`, prefer the file or the variable",
    )
    parser.add_argument("--api-key-file", default="", help="file holding the API key (takes precedence over --api-key)")


def api_key_from_args(args: argparse.Namespace) -> str:
    """The API key the flags name ("" when none). Raises as ``read_secret``."""
    return read_secret(args.api_key, args.api_key_file, "the API key")


def gateway_config_from_args(args: argparse.Namespace, model: Path) -> GatewayConfig:
    """Builds the config from parsed flags; ``model`` is the resolved model folder.

    Raises:
        ValueError: a value out of range, no cluster token, or only one of the TLS files.
        OSError: a secret file cannot be read.
    """
    return GatewayConfig(
        model=model,
        redis_url=redis_url_from_args(args),
        cluster_token=cluster_token_from_args(args),
        api_key=api_key_from_args(args),
        tls_cert_file=Path(args.tls_cert_file) if args.tls_cert_file else None,
        tls_key_file=Path(args.tls_key_file) if args.tls_key_file else None,
        host=args.host,
        port=args.port,
        gateway_id=args.gateway_id or f"gateway-{uuid.uuid4().hex[:8]}",
        max_concurrent_requests=args.max_concurrent_requests,
        metrics_port=args.metrics_port,
        http_port=args.http_port,
        served_model_name=args.served_model_name,
        shutdown_grace_s=args.shutdown_grace_s,
        http_header_timeout_s=args.http_header_timeout_s,
    )
