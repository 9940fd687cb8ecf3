"""Every service's Redis client, built in one place: a blocking connection pool of a stated size.

redis-py's default pool holds at most 100 connections and fails a command at once ("Too many
connections") when all are busy; a gateway with more requests arriving together than that answered
the rest with UNAVAILABLE. Here a command that finds every connection busy waits up to
``POOL_WAIT_S`` for one to come back, and only then fails with ``PoolExhaustedError`` (a
``redis.ConnectionError``, so callers treat it as Redis being unreachable: the gateway answers
UNAVAILABLE, HTTP 503, "retry later"), whose message says what happened.
"""

from __future__ import annotations

import asyncio
import queue

import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

SOCKET_TIMEOUT_S = 10.0
"""Longest wait for one Redis reply, seconds (a command that times out is retried, ``_connection_options``)."""

POOL_WAIT_S = 10.0
"""Longest wait for a free pooled connection before a command fails, seconds."""

THREADED_SERVICE_MAX_CONNECTIONS = 16
"""Pool size of the thread-based services (scheduler, worker): each of their few threads that talk
to Redis (request reader, cluster watch, Redis writes, registrations) holds one connection at a time."""


class PoolExhaustedError(redis.ConnectionError):
    """No pooled connection came free within the wait (``POOL_WAIT_S``): Redis is slow or this
    process sends more commands at once than its pool holds."""


def _exhausted(max_connections: int, wait_s: float) -> PoolExhaustedError:
    return PoolExhaustedError(
        f"all {max_connections} Redis connections of this process stayed busy for {wait_s:g} s "
        "(Redis is slow or overloaded)")


def _check_size(max_connections: int) -> None:
    if max_connections < 1:  # redis-py would take 0 for its default
        raise ValueError(f"a Redis pool needs at least one connection, got {max_connections}")


def _connection_options(retry_class: type) -> dict:
    """Timeouts, health checks and retries of every pooled connection. The retries reconnect after a
    Redis restart (a pooled connection to the old server is dead)."""
    return dict(socket_connect_timeout=2, socket_timeout=SOCKET_TIMEOUT_S, health_check_interval=5,
                retry=retry_class(ExponentialBackoff(cap=1.0, base=0.05), retries=5),
                retry_on_error=[redis.ConnectionError, redis.TimeoutError])


class _BlockingPool(redis.BlockingConnectionPool):
    """redis-py's blocking pool, failing with ``PoolExhaustedError`` when the wait times out."""

    def get_connection(self, *args, **kwargs):
        try:
            return super().get_connection()
        except redis.ConnectionError as exc:
            if isinstance(exc.__context__, queue.Empty):  # the wait for a free one timed out
                raise _exhausted(self.max_connections, self.timeout) from exc
            raise


class _AsyncBlockingPool(aioredis.BlockingConnectionPool):
    """redis-py's asyncio blocking pool, failing with ``PoolExhaustedError`` when the wait times out."""

    async def get_connection(self, *args, **kwargs):
        try:
            return await super().get_connection()
        except redis.ConnectionError as exc:
            if isinstance(exc.__cause__, (TimeoutError, asyncio.TimeoutError)):  # the wait timed out
                raise _exhausted(self.max_connections, self.timeout) from exc
            raise


class _CancellableRedis(aioredis.Redis):
    """redis-py's asyncio client, with a cancellation that arrives during a command never lost.

    redis-py 8 puts ``asyncio.wait_for`` around socket writes when a socket timeout is set (always
    here; by default since redis-py 8). Python 3.11's ``wait_for`` returns, dropping the
    ``CancelledError``, when its task is cancelled just as the awaited write completes (CPython issue
    gh-86296, fixed in 3.12): a cancelled gateway loop then ran on for ever (a gateway test hung on it
    1 run in 6; 1,568 of 2,000 cancels of a loop of HGETALLs were lost). A command during which its
    task was cancelled raises ``CancelledError`` once it has ended, whether it returned or failed (the
    gateway's loops catch ``redis.RedisError`` and go on); a cancellation requested before the command
    started (a clean-up in a ``finally``) does not. Only ``execute_command`` is covered: the gateway
    uses no pipeline or pub/sub.
    """

    async def execute_command(self, *args, **options):
        task = asyncio.current_task()
        cancels_before = task.cancelling()
        try:
            return await super().execute_command(*args, **options)
        finally:
            if task.cancelling() > cancels_before:
                raise asyncio.CancelledError  # replaces the result or the command's own error


def threaded_redis_client(url: str, max_connections: int = THREADED_SERVICE_MAX_CONNECTIONS,
                          wait_s: float = POOL_WAIT_S) -> redis.Redis:
    """A client for ``url`` on a blocking pool of ``max_connections`` (thread-safe).

    Raises:
        ValueError: ``url`` is not a Redis URL, or ``max_connections`` is not positive.
    """
    _check_size(max_connections)
    pool = _BlockingPool.from_url(url, max_connections=max_connections, timeout=wait_s,
                                  **_connection_options(Retry))
    return redis.Redis.from_pool(pool)


def async_redis_client(url: str, max_connections: int, wait_s: float = POOL_WAIT_S) -> aioredis.Redis:
    """An asyncio client for ``url`` on a blocking pool of ``max_connections``; ``aclose()`` closes
    the pool too.

    Raises:
        ValueError: ``url`` is not a Redis URL, or ``max_connections`` is not positive.
    """
    _check_size(max_connections)
    pool = _AsyncBlockingPool.from_url(url, max_connections=max_connections, timeout=wait_s,
                                       **_connection_options(AsyncRetry))
    return _CancellableRedis.from_pool(pool)
