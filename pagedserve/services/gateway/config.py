"""The gateway service's configuration, validated at start and never changed."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path

from pagedserve.options import option
from pagedserve.text.tool_parsers import ToolCallParserKind
from pagedserve.services.common.auth import MISSING_CLUSTER_TOKEN, api_key_option, cluster_token_option
from pagedserve.services.common.metrics import check_metrics_port, metrics_port_option
from pagedserve.services.common.service_args import (
    DEFAULT_HTTP_PORT, DEFAULT_PORT, host_option, model_option, port_option, redis_url_option,
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
    """Settings of one gateway process (the option fields are its flags, documented by their help).

    Raises:
        ValueError: a value out of range, no cluster token, or only one of the TLS files.
    """

    model: Path = model_option()
    redis_url: str = redis_url_option()
    cluster_token: str = cluster_token_option()
    host: str = host_option()
    port: int = port_option(DEFAULT_PORT)
    metrics_port: int | None = metrics_port_option()
    api_key: str = api_key_option()
    tls_cert_file: Path | None = option("PEM certificate (chain) to serve TLS with; the gateway then serves TLS only",
                                        None, default_help="plaintext")
    tls_key_file: Path | None = option("PEM private key of --tls-cert-file", None)
    gateway_id: str = option("unique gateway id; the schedulers route tokens by it",
                             default_factory=lambda: f"gateway-{uuid.uuid4().hex[:8]}", default_help="gateway-<random>")
    max_concurrent_requests: int = option(
        "requests in flight before new ones are refused with RESOURCE_EXHAUSTED, HTTP 429", 1024)
    shutdown_grace_s: float = option(
        "on SIGTERM or SIGINT, seconds the requests in flight may take to finish while health is NOT_SERVING and "
        "new ones are refused with UNAVAILABLE (HTTP 503); those left then end with UNAVAILABLE and the process "
        f"exits within {SHUTDOWN_CLOSE_S:g} s more: keep the supervisor's grace period (Kubernetes "
        f"terminationGracePeriodSeconds) {SHUTDOWN_CLOSE_S:g} s longer", 30.0)
    http_header_timeout_s: float = option(
        "seconds an HTTP connection has to send a request's complete headers (from opening, or from its first "
        "byte after a previous request) before it is closed; idle keep-alive connections close after "
        "http_server.KEEP_ALIVE_S", 10.0)
    send_timeout_s: float = option(
        "seconds a streamed response (gRPC Generate, or HTTP) may wait for its client to read (flow control or "
        "the connection's buffers full) before the stream is cut and its requests aborted, which frees their "
        "places among --max-concurrent-requests", 30.0)
    http_port: int = option(
        "port of the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models, /health, "
        "/tokenize, /detokenize) on the same --host; 0 picks a free one (logged)", DEFAULT_HTTP_PORT)
    served_model_name: str = option("model name HTTP clients send as `model` and /v1/models lists", "",
                                    default_help="the model folder's name")
    tool_call_parser: ToolCallParserKind = option(
        "how chat answers write tool calls, parsed into message.tool_calls (hermes: <tool_call>{\"name\": ..., "
        "\"arguments\": {...}}</tool_call>, as Hermes and Qwen2.5 models and the fallback tools prompt write them)",
        ToolCallParserKind.HERMES)

    def __post_init__(self) -> None:
        object.__setattr__(self, "tool_call_parser", ToolCallParserKind(self.tool_call_parser))
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
        if not 0 < self.send_timeout_s <= 3600:
            raise ValueError(f"--send-timeout-s must be in (0, 3600], got {self.send_timeout_s}")
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
