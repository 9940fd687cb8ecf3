"""Puts tokenized requests on the Redis request stream (XADD), signed with the cluster token."""

from __future__ import annotations

import logging

import redis
import redis.asyncio as aioredis

from services.common import redis_keys
from services.common.convert import request_to_pb
from services.common.signed_records import sign_record
from pagedserve.engine.messages import EngineRequest

log = logging.getLogger("pagedserve.gateway")


class RequestQueueProducer:
    """Appends protobuf-encoded ``QueuedRequest`` records to the request stream, each signed with the
    cluster token (``signed_records``): schedulers drop a record that is not, so a writer to Redis
    cannot queue a prompt of its own under a client's request id and gateway."""

    def __init__(self, client: aioredis.Redis, gateway_id: str, cluster_token: str) -> None:
        self._client = client
        self._gateway_id = gateway_id
        self._token = cluster_token

    async def enqueue(self, request: EngineRequest) -> bytes:
        """Queues a request for the scheduler; returns its stream entry id.

        Raises:
            redis.RedisError: Redis unreachable.
        """
        record = request_to_pb(request, self._gateway_id)
        sign_record(record, self._token)
        fields = {redis_keys.REQUEST_FIELD: record.SerializeToString()}
        return await self._client.xadd(redis_keys.REQUEST_STREAM, fields)

    async def lost(self, entry_id: bytes) -> bool:
        """Whether the entry is gone from the stream (False when Redis cannot say)."""
        try:
            return not await self._client.xrange(redis_keys.REQUEST_STREAM, entry_id, entry_id)
        except redis.RedisError:
            return False

    async def forget(self, entry_id: bytes) -> None:
        """Deletes a request's stream entry (its client went away); Redis errors are logged."""
        try:
            await self._client.xdel(redis_keys.REQUEST_STREAM, entry_id)
        except redis.RedisError as exc:
            log.warning("could not delete stream entry %r: %s", entry_id, exc)

    async def ping(self) -> bool:
        try:
            return bool(await self._client.ping())
        except Exception:
            return False
