"""The worker service's configuration, validated at start and never changed."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path

from pagedserve.engine.config import DEFAULT_BLOCK_SIZE
from pagedserve.engine.runner_config import RunnerConfig
from pagedserve.engine.spec_decode.config import SpeculativeConfig
from pagedserve.options import nested, option
from pagedserve.units import parse_cpu_list
from pagedserve.services.common.auth import MISSING_CLUSTER_TOKEN, cluster_token_option
from pagedserve.services.common.metrics import check_metrics_port, metrics_port_option
from pagedserve.services.common.service_args import (advertise_host_option, default_advertise_host, host_option,
                                                     model_option, port_option, redis_url_option)


@dataclass(frozen=True)
class WorkerConfig:
    """Settings of one worker process (the option fields are its flags, documented by their help).

    Attributes:
        heartbeat_interval_s: how often the registration is refreshed, seconds.

    Raises:
        ValueError: a value out of range, or no cluster token.
    """

    model: Path = model_option()
    redis_url: str = redis_url_option()
    cluster_token: str = cluster_token_option()
    host: str = host_option()
    port: int = port_option(0)
    metrics_port: int | None = metrics_port_option()
    advertise_host: str = advertise_host_option(env="PAGEDSERVE_ADVERTISE_HOST")
    worker_id: str = option("unique worker id", default_factory=lambda: f"worker-{uuid.uuid4().hex[:8]}",
                            default_help="worker-<random>")
    block_size: int = option("token slots per KV block (the scheduler's --block-size)", DEFAULT_BLOCK_SIZE)
    runner: RunnerConfig = nested("model runners", RunnerConfig())
    speculative_config: SpeculativeConfig = nested(
        "speculative decoding (the worker drafts and verifies; its schedulers need the same method and k)",
        SpeculativeConfig())
    num_threads: int = option("torch CPU threads; 0: one per --cpu-affinity core, else torch's default", 0)
    rank_address: str = option(
        "with --local-ranks K < T*P: listen here for ranks K..T*P-1, started on other machines with `pagedserve "
        "worker-rank --rank R --rank-address HOST:PORT` and the cluster token; the gloo rendezvous is at PORT+1",
        "", metavar="HOST:PORT", default_help="every rank on this machine")
    local_ranks: int = option("ranks 0..K-1 run on this machine, the others dial --rank-address; 0: all T*P", 0,
                              metavar="K")
    rank_join_timeout_s: float = option("seconds rank 0 waits for the remote ranks to join before failing at start",
                                        300.0, flag="rank-join-timeout", metavar="SECONDS")
    cpu_affinity: tuple[int, ...] = option(
        "run every thread of the worker (torch's OpenMP team included) on these CPU cores (e.g. 0-3); give each "
        "worker on a machine its own cores", (), parse=parse_cpu_list, show=lambda cores: ",".join(map(str, cores)),
        default_help="no binding")
    heartbeat_interval_s: float = 1.0

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        check_metrics_port(self.metrics_port)
        if not self.advertise_host:
            object.__setattr__(self, "advertise_host", default_advertise_host(self.host))
        if self.block_size < 1:
            raise ValueError(f"--block-size must be positive, got {self.block_size}")
        if self.num_threads < 0:
            raise ValueError(f"--num-threads must be >= 0, got {self.num_threads}")
        if self.local_ranks or self.rank_address:
            from pagedserve.engine.parallel.rank_link import RankPlacement

            RankPlacement(self.rank_address, self.local_ranks, self.cluster_token.encode()).spawned(self.runner.ranks)
        if not self.heartbeat_interval_s > 0:  # NaN too
            raise ValueError(f"heartbeat_interval_s must be positive, got {self.heartbeat_interval_s}")
        if not self.cluster_token:
            raise ValueError(MISSING_CLUSTER_TOKEN)
