"""Waiting for Redis at start, so services can be started in any order."""

from __future__ import annotations

import logging
import threading

import redis

from pagedserve.services.common.redis_pool import threaded_redis_client
from pagedserve.services.common.service_args import redact_url

log = logging.getLogger("pagedserve")


def connect_redis(url: str, stop: threading.Event, timeout_s: float = 120.0) -> redis.Redis:
    """A client for ``url`` (``redis_pool.threaded_redis_client``) once Redis answers a PING; logs
    while it waits.

    Raises:
        ConnectionError: Redis did not answer within ``timeout_s`` (or ``stop`` was set).
    """
    client = threaded_redis_client(url)
    shown = redact_url(url)
    waited = 0.0
    while not stop.is_set():
        try:
            client.ping()
            return client
        except redis.RedisError as exc:
            if waited >= timeout_s:
                raise ConnectionError(f"Redis at {shown} did not answer for {timeout_s:.0f} s: {exc}") from exc
            if waited % 10 == 0:
                log.warning("waiting for Redis at %s (%s)", shown, exc)
            stop.wait(1.0)
            waited += 1.0
    raise ConnectionError(f"stopped while waiting for Redis at {shown}")
