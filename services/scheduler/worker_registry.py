"""Learns the live workers from their registrations and heartbeats in Redis."""

from __future__ import annotations

import logging

import redis
from google.protobuf.message import DecodeError

from services.common import redis_keys
from services.common.auth import registration_is_signed
from services.common.pb import engine_pb2 as pb

log = logging.getLogger("pagedserve.scheduler")


class WorkerRegistry:
    """Reads worker registrations; a worker whose heartbeat key expired counts as gone.

    Registrations not signed with the cluster token (``services.common.auth.sign_registration``)
    are ignored and logged once each: only a holder of the token can add a worker.
    """

    def __init__(self, client: redis.Redis, cluster_token: str) -> None:
        self._client = client
        self._token = cluster_token
        self._refused: set[bytes] = set()

    def live_workers(self) -> dict[str, pb.WorkerRegistration]:
        """Registrations of the workers whose heartbeat is fresh, by worker id.

        Stale registrations are deleted.

        Raises:
            redis.RedisError: Redis unreachable.
        """
        raw = self._client.hgetall(redis_keys.WORKERS_HASH)
        registrations = {}
        for value in raw.values():
            reg = self._verified(value)
            if reg is not None:
                registrations[reg.worker_id] = reg
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

    def _verified(self, value: bytes) -> pb.WorkerRegistration | None:
        reg = pb.WorkerRegistration()
        try:
            reg.ParseFromString(value)
        except DecodeError:
            reg = None
        if reg is not None and registration_is_signed(reg, self._token):
            return reg
        if value not in self._refused and len(self._refused) < 1024:
            self._refused.add(value)
            log.error("ignoring a worker registration not signed with this cluster token (%s at %s): a worker "
                      "with another token, or someone writing to Redis", reg.worker_id if reg else "undecodable",
                      reg.address if reg else "?")
        return None
