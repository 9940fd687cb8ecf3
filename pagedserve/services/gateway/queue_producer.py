"""Puts tokenized requests on the Redis request stream (XADD, once per submission), signed with the
cluster token."""

from __future__ import annotations

import logging
import secrets

import redis
import redis.asyncio as aioredis

from pagedserve.services.common import redis_keys
from pagedserve.services.common.convert import request_to_pb
from pagedserve.services.common.signed_records import sign_record
from pagedserve.engine.messages import EngineRequest

log = logging.getLogger("pagedserve.gateway")

_QUEUE_ONCE = """
local queued = redis.call('GET', KEYS[2])
if queued then return queued end
local id = redis.call('XADD', KEYS[1], '*', ARGV[1], ARGV[2])
redis.call('SET', KEYS[2], id, 'EX', ARGV[3])
return id
"""
"""XADD of one submission at most once. redis-py sends a command again when its reply is lost (a
timeout, a broken connection: ``redis_pool``'s retries); a second XADD would queue the request twice,
and the copy would run for nobody until the gateway aborted it. KEYS: the stream, the submission's
mark (``redis_keys.submission_key``); ARGV: the field, the record, the mark's TTL in seconds."""

SUBMISSION_MARK_S = 120
"""How long a submission's mark outlives its XADD, seconds: longer than redis-py's retries of one
command can take (``redis_pool``: 5 retries of a 10 s socket timeout, backoff under 1 s: ~66 s)."""


class RequestQueueProducer:
    """Appends protobuf-encoded ``QueuedRequest`` records to the request stream, each signed with the
    cluster token (``signed_records``): schedulers drop a record that is not, so a writer to Redis
    cannot queue a prompt of its own under a client's request id and gateway."""

    def __init__(self, client: aioredis.Redis, gateway_id: str, cluster_token: str) -> None:
        self._client = client
        self._gateway_id = gateway_id
        self._token = cluster_token
        self._queue_once = client.register_script(_QUEUE_ONCE)

    async def enqueue(self, request: EngineRequest) -> bytes:
        """Queues a request for the scheduler once (``_QUEUE_ONCE``: however often redis-py sends the
        command); returns its stream entry id. Each call is a submission of its own: a request queued
        again after Redis lost it gets a new entry.

        Raises:
            redis.RedisError: Redis unreachable.
        """
        record = request_to_pb(request, self._gateway_id)
        sign_record(record, self._token)
        mark = redis_keys.submission_key(secrets.token_hex(16))
        return await self._queue_once(keys=[redis_keys.REQUEST_STREAM, mark],
                                      args=[redis_keys.REQUEST_FIELD, record.SerializeToString(), SUBMISSION_MARK_S])

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
