"""A worker's registration in Redis, kept alive by a heartbeat thread."""

from __future__ import annotations

import threading

import redis

from pagedserve.services.common import redis_keys
from pagedserve.services.common.pb import engine_pb2 as pb
from pagedserve.services.common.signed_records import sign_record


class WorkerRegistrar:
    """Publishes a ``WorkerRegistration`` and refreshes its heartbeat key until stopped.

    The heartbeat key expires after three missed intervals, so the scheduler notices a worker
    that died without unregistering. Each beat rewrites the registration with its ``heartbeat``
    count one higher (signed again under ``cluster_token``): the scheduler's proof that a worker
    whose step failed runs again (``pagedserve.services.scheduler.membership``).
    """

    def __init__(self, client: redis.Redis, registration: pb.WorkerRegistration, interval_s: float,
                 cluster_token: str) -> None:
        self._client = client
        self._registration = registration
        self._cluster_token = cluster_token
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="worker-heartbeat", daemon=True)

    def start(self) -> None:
        """Registers now (raising on Redis errors) and starts the heartbeat thread."""
        self._beat()
        self._thread.start()

    def stop(self) -> None:
        """Stops the heartbeat and removes the registration."""
        self._stop.set()
        self._thread.join(timeout=5)
        worker_id = self._registration.worker_id
        try:
            self._client.hdel(redis_keys.WORKERS_HASH, worker_id)
            self._client.delete(redis_keys.worker_heartbeat_key(worker_id))
        except redis.RedisError:
            pass  # the heartbeat key expires on its own

    def _beat(self) -> None:
        worker_id = self._registration.worker_id
        self._registration.heartbeat += 1
        sign_record(self._registration, self._cluster_token)
        pipe = self._client.pipeline()
        pipe.hset(redis_keys.WORKERS_HASH, worker_id, self._registration.SerializeToString())
        pipe.set(redis_keys.worker_heartbeat_key(worker_id), b"1", px=int(self._interval_s * 3000))
        pipe.execute()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self._beat()
            except redis.RedisError:
                continue  # Redis restarting: try again next interval
