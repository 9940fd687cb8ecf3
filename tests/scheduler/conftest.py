"""Fixtures of the scheduler tests that need Redis: a real redis-server on a free loopback port."""

from __future__ import annotations

import pytest
import redis

from pagedserve.services.scheduler.queue_consumer import RequestQueueConsumer
from tests.e2e.processes import RECORDS, start_redis


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    """A redis-server of this test module's own."""
    process, url = start_redis(tmp_path_factory.mktemp("redis"))
    yield url
    process.stop()


@pytest.fixture()
def client(redis_url):
    """A client of an emptied Redis holding the request stream and its consumer group."""
    client = redis.Redis.from_url(redis_url)
    client.flushall()
    RequestQueueConsumer(client, "setup", RECORDS).ensure_group()
    return client
