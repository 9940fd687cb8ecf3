"""The scheduler service's configuration (the engine's limits are ``pagedserve.engine.config``)."""

from __future__ import annotations

import socket
from dataclasses import dataclass

from pagedserve.engine.config import SchedulerConfig
from pagedserve.engine.spec_decode.config import SpeculativeConfig
from pagedserve.options import nested, option
from pagedserve.services.common.auth import MISSING_CLUSTER_TOKEN, cluster_token_option
from pagedserve.services.common.limits import MAX_LEASE_TTL_S
from pagedserve.services.common.metrics import check_metrics_port, metrics_port_option
from pagedserve.services.common.service_args import (DEFAULT_SCHEDULER_PORT, advertise_host_option,
                                                     default_advertise_host, host_option, port_option, redis_url_option)


@dataclass(frozen=True)
class SchedulerServiceConfig:
    """Settings of the scheduler process (the option fields are its flags, documented by their help).

    Attributes:
        worker_poll_interval_s: how often registrations are re-read from Redis, seconds.
        worker_gone_after_s: how long a worker's registration may be missing (a Redis restart)
            before the worker counts as gone, seconds.
        gateway_grace_s: how long a gateway's requests survive its output stream being closed
            (long enough for it to reconnect), seconds.

    Raises:
        ValueError: a value out of range, or no cluster token.
    """

    redis_url: str = redis_url_option()
    cluster_token: str = cluster_token_option()
    host: str = host_option()
    port: int = port_option(DEFAULT_SCHEDULER_PORT)
    metrics_port: int | None = metrics_port_option()
    policy: SchedulerConfig = nested("scheduling (per worker and iteration)", SchedulerConfig())
    speculative_config: SpeculativeConfig = nested(
        "speculative decoding (the scheduler reserves KV slots for k drafts per decode; its workers must be "
        "started with the same method and k, or are not admitted; the prompt-lookup bounds and the draft model are "
        "the workers')",
        SpeculativeConfig())
    consumer_name: str = option(
        "this scheduler's id and its name in the Redis consumer group: unique per scheduler, kept across restarts "
        "so that its unfinished requests are resumed by it (a peer resumes them once its lease expired)",
        default_factory=socket.gethostname, default_help="the host name, which is unique per container or pod")
    advertise_host: str = advertise_host_option()
    lease_ttl_s: float = option(
        "seconds a scheduler's lease (and its leases on workers) lasts without renewal: a scheduler that dies is "
        f"taken over this long after its last renewal (at most {MAX_LEASE_TTL_S:g})", 3.0, flag="lease-ttl")
    migration_limit: int = option(
        "most times one request may move to another scheduler (after a scheduler died or gave it up); beyond "
        "it the request fails with UNAVAILABLE", 3)
    step_timeout_s: float = option(
        "seconds a worker may take for one iteration before the step counts as failed; the worker is then reset "
        "and admitted again, its sequences recomputed", 120.0, flag="step-timeout")
    no_worker_timeout_s: float = option(
        "seconds a request waits while no worker is up in the cluster (here or at a peer scheduler) before it "
        "fails with UNAVAILABLE", 30.0,
        flag="no-worker-timeout")
    worker_poll_interval_s: float = 0.5
    worker_gone_after_s: float = 5.0
    gateway_grace_s: float = 10.0

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        check_metrics_port(self.metrics_port)
        if not self.advertise_host:
            object.__setattr__(self, "advertise_host", default_advertise_host(self.host))
        if not self.consumer_name or ":" in self.consumer_name or len(self.consumer_name) > 128:
            raise ValueError(f"--consumer-name must be 1-128 characters without ':', got {self.consumer_name!r}")
        for name in ("step_timeout_s", "worker_poll_interval_s", "worker_gone_after_s", "no_worker_timeout_s",
                     "gateway_grace_s"):
            if not getattr(self, name) > 0:  # NaN too
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not 3 * self.worker_poll_interval_s <= self.lease_ttl_s <= MAX_LEASE_TTL_S:  # NaN too
            raise ValueError(f"--lease-ttl must be in [{3 * self.worker_poll_interval_s:g}, {MAX_LEASE_TTL_S:g}] s (at "
                             f"least three renewals), got {self.lease_ttl_s:g}")
        if self.migration_limit < 0:
            raise ValueError(f"--migration-limit must be >= 0, got {self.migration_limit}")
        if not self.cluster_token:
            raise ValueError(MISSING_CLUSTER_TOKEN)
