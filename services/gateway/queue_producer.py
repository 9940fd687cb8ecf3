"""Puts tokenized requests on the Redis request stream (XADD)."""

from __future__ import annotations

import redis.asyncio as aioredis

from services.common import redis_keys
from services.common.convert import request_to_pb
from pagedserve.engine.messages import EngineRequest


class RequestQueueProducer:
    """Appends protobuf-encoded ``QueuedRequest`` records to the request stream."""

    def __init__(self, client: aioredis.Redis, gateway_id: str) -> None:
        self._client = client
        self._gateway_id = gateway_id

    async def enqueue(self, request: EngineRequest) -> None:
        """Queues a request for the scheduler.

        Raises:
            redis.RedisError: Redis unreachable.
        """
        record = request_to_pb(request, self._gateway_id).SerializeToString()
        await self._client.xadd(redis_keys.REQUEST_STREAM, {redis_keys.REQUEST_FIELD: record})

    async def ping(self) -> bool:
        try:
            return bool(await self._client.ping())
        except Exception:
            return False
