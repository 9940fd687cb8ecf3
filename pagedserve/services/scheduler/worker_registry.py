"""Learns the live workers from their registrations and heartbeats in Redis."""

from __future__ import annotations

import redis

from pagedserve.services.common import redis_keys
from pagedserve.services.common.pb import engine_pb2 as pb
from pagedserve.services.common.signed_records import RecordCheck, SignedHash


class WorkerRegistry:
    """Reads worker registrations; a worker whose heartbeat key expired counts as gone.

    Registrations not signed with the cluster token (``pagedserve.services.common.signed_records``), or stored
    under another field than their worker id, are ignored, counted and logged once each: only a
    holder of the token can add a worker.
    """

    def __init__(self, client: redis.Redis, check: RecordCheck) -> None:
        self._client = client
        self._registrations = SignedHash(pb.WorkerRegistration, check, lambda reg: reg.worker_id)

    def live_workers(self) -> dict[str, pb.WorkerRegistration]:
        """Registrations of the workers whose heartbeat is fresh, by worker id.

        Stale registrations are deleted.

        Raises:
            redis.RedisError: Redis unreachable.
        """
        registrations = self._registrations.verified(self._client.hgetall(redis_keys.WORKERS_HASH))
        if not registrations:
            return {}
        pipe = self._client.pipeline()
        for worker_id in registrations:
            pipe.exists(redis_keys.worker_heartbeat_key(worker_id))
        alive = pipe.execute()
        stale = [wid for wid, ok in zip(registrations, alive) if not ok]
        if stale:
            self._client.hdel(redis_keys.WORKERS_HASH, *stale)
        return {wid: reg for wid, reg in registrations.items() if wid not in stale}
