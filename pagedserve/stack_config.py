"""What `pagedserve up` starts (``StackConfig``: its flags, the services' configs composed): the
ports each service listens on, and the torch threads of each worker."""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

from pagedserve.services.common.auth import api_key_option, cluster_token_option
from pagedserve.services.common.grpc_server import host_port
from pagedserve.engine.config import SchedulerConfig
from pagedserve.engine.runner_config import DEFAULT_KV_CACHE_MEMORY, RunnerConfig
from pagedserve.engine.spec_decode.config import SpeculativeConfig
from pagedserve.local_redis import REDIS_PORT
from pagedserve.model_files import default_cache_dir
from pagedserve.options import nested, option
from pagedserve.stack_ports import Port, local_redis, same_port_twice
from pagedserve.services.common.service_args import (DEFAULT_HTTP_PORT, DEFAULT_PORT, DEFAULT_SCHEDULER_PORT,
                                                     bare_host, model_option, redis_url_option)


@dataclass(frozen=True)
class StackConfig:
    """What `pagedserve up` starts: the services' configs composed (the option fields are its flags,
    documented by their help; ``redis_url``, ``cluster_token`` and ``api_key`` reach the children
    through the environment, so `ps` does not show them).

    Attributes:
        data_dir: where a Redis started by us keeps its append-only file; None: ``redis-<port>`` in
            ``pagedserve.model_files.default_cache_dir()``.
        startup_timeout_s: how long to wait for everything to be healthy, seconds.
        redis_password: password of a Redis started by us when ``redis_url`` has none (default: a
            new random one); written to ``redis_password_file`` for other clients.
    """

    model: Path = model_option()
    redis_url: str = redis_url_option()
    cluster_token: str = cluster_token_option("default: a new random one")
    api_key: str = api_key_option()
    workers: int = option("number of worker processes", 1)
    schedulers: int = option("number of scheduler processes: each owns some workers, and the others take over "
                             "the requests and workers of one that dies", 1)
    host: str = option("gateway listen address; 0.0.0.0 serves other machines too", "127.0.0.1", parse=bare_host)
    port: int = option("gateway gRPC port", DEFAULT_PORT)
    http_port: int = option("gateway OpenAI-compatible HTTP API port", DEFAULT_HTTP_PORT)
    scheduler_port: int = option("port of the first scheduler; scheduler i listens on PORT+i", DEFAULT_SCHEDULER_PORT)
    metrics_port: int = option("Prometheus /metrics of the gateway at PORT (on --host), scheduler i at PORT+1+i and "
                               "worker i after them, on 127.0.0.1 (with one scheduler: PORT+2+i); 0: none", 9450,
                               metavar="PORT")
    threads_per_worker: int = option("torch threads per worker; each worker gets its own cores when they fit", 0,
                                     default_help="CPU cores / workers")
    policy: SchedulerConfig = nested("scheduling (per worker and iteration)", SchedulerConfig())
    runner: RunnerConfig = nested("the workers' model runners", RunnerConfig(kv_cache_memory=DEFAULT_KV_CACHE_MEMORY),
                                  exclude=("dtype", "device", "attention_backend", "gpu_memory_utilization"))
    speculative_config: SpeculativeConfig = nested("speculative decoding (passed to the schedulers and the workers)",
                                                   SpeculativeConfig())
    data_dir: Path | None = None
    startup_timeout_s: float = 600.0
    redis_password: str = field(default_factory=lambda: secrets.token_hex(24), repr=False)

    def __post_init__(self) -> None:
        if self.workers < 1 or self.schedulers < 1:
            raise ValueError(f"--workers and --schedulers must be at least 1, got {self.workers}, {self.schedulers}")
        if not self.cluster_token:
            object.__setattr__(self, "cluster_token", secrets.token_hex(32))
        if self.data_dir is None:
            port = urlparse(self.redis_url).port or REDIS_PORT
            object.__setattr__(self, "data_dir", default_cache_dir() / f"redis-{port}")
        if not self.threads_per_worker:
            object.__setattr__(self, "threads_per_worker", default_threads_per_worker(self.workers))
        if not 0 <= self.scheduler_port <= 65535 - self.schedulers:
            raise ValueError(f"--scheduler-port must leave room for {self.schedulers} ports, got {self.scheduler_port}")
        if not 0 <= self.metrics_port <= 65535 - 1 - self.schedulers - self.workers:
            raise ValueError(f"--metrics-port must leave room for {self.workers + self.schedulers + 1} ports, "
                             f"got {self.metrics_port}")
        redis = local_redis(self.redis_url)  # a Redis that `up` would start on it
        clash = same_port_twice(self.listen_ports() + ([redis] if redis else []))
        if clash is not None:
            raise ValueError(clash)

    def gateway_address(self, port: int) -> str:
        """host:port at which this machine reaches the gateway's ``port`` (its gRPC, HTTP or metrics port):
        at ``--host``, or at the loopback address when the gateway listens on every address (0.0.0.0, ::)."""
        return host_port(WILDCARD_TO_LOOPBACK.get(self.host, self.host), port)

    def scheduler_addresses(self) -> dict[str, str]:
        """Scheduler name (also its --consumer-name) -> host:port."""
        return {f"scheduler-{i}": f"127.0.0.1:{self.scheduler_port + i}" for i in range(self.schedulers)}

    @property
    def redis_password_file(self) -> Path:
        """Where a Redis started by us with ``redis_password`` has it written (readable by this user only)."""
        return self.data_dir / "redis-password"

    def listen_ports(self) -> list[Port]:
        """Every port the stack's services listen on (Redis aside)."""
        ports = [Port("gateway gRPC", self.host, self.port), Port("gateway HTTP", self.host, self.http_port)]
        ports += [Port(f"scheduler-{i}", "127.0.0.1", self.scheduler_port + i) for i in range(self.schedulers)]
        return ports + [Port(f"{name} metrics", self.host if name == "gateway" else "127.0.0.1", port)
                        for name, port in self.metrics_ports().items()]

    def metrics_ports(self) -> dict[str, int]:
        """Service name -> its ``/metrics`` port (empty when metrics are off)."""
        if not self.metrics_port:
            return {}
        names = ["gateway", *self.scheduler_addresses(), *(f"worker-{i}" for i in range(self.workers))]
        return {name: self.metrics_port + i for i, name in enumerate(names)}


WILDCARD_TO_LOOPBACK = {"0.0.0.0": "127.0.0.1", "::": "::1"}
"""A listen address meaning "every address of this machine" -> the one to dial it at from this machine."""


def default_threads_per_worker(workers: int) -> int:
    """Torch threads of each of ``workers`` workers on this machine: its cores shared out, at least 1."""
    return max(1, (os.cpu_count() or 1) // workers)
