"""The scheduler's request reader with a real redis-server: an entry Redis moved to this scheduler
reaches the loop even when the reader failed between reading it and handing it over."""

from __future__ import annotations

import threading
from collections.abc import Callable
import time
from types import SimpleNamespace

import pytest
import redis

from pagedserve.services.common import redis_keys
from pagedserve.services.common.pb import engine_pb2 as pb
from pagedserve.services.scheduler.leases import Leases
from pagedserve.services.scheduler.queue_consumer import Delivery, RequestQueueConsumer
from pagedserve.services.scheduler.request_reader import RequestReader
from tests.e2e.processes import RECORDS, start_redis


@pytest.fixture
def client(tmp_path):
    process, url = start_redis(tmp_path)
    yield redis.Redis.from_url(url)
    process.stop()


class Loop:
    """The loop's side the reader sees: it records every entry handed over."""

    def __init__(self) -> None:
        self.accepting = threading.Event()
        self.accepting.set()
        self.model_name = ""
        self.stats = SimpleNamespace(num_waiting=0, num_running=0)
        self.entries = []

    def submit(self, command) -> None:
        self.entries.extend(command.entries)


class Watch:
    def __init__(self) -> None:
        self.lease_held = threading.Event()
        self.lease_held.set()
        self.peer_loads = {}


def put(client: redis.Redis, request_id: str) -> None:
    record = RECORDS.sign(pb.QueuedRequest(request_id=request_id, gateway_id="gw", prompt_token_ids=[1]))
    client.xadd(redis_keys.REQUEST_STREAM, {redis_keys.REQUEST_FIELD: record})


def handed_over(client: redis.Redis, leases: Leases, before: Callable[[Loop], None]) -> list[tuple[str, Delivery]]:
    """Runs a reader of consumer ``scheduler-0`` over ``leases``, calls ``before(loop)`` and waits up to
    10 s for entries to reach the loop; returns each one's request id and delivery."""
    consumer = RequestQueueConsumer(client, "scheduler-0", RECORDS)
    consumer.ensure_group()
    loop, stop = Loop(), threading.Event()
    thread = threading.Thread(target=RequestReader(consumer, loop, Watch(), leases, None).run, args=(stop,),
                              daemon=True)
    thread.start()
    try:
        before(loop)
        deadline = time.monotonic() + 10
        while not loop.entries and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        stop.set()
        thread.join(5)
    return [(e.request.request_id, e.delivery) for e in loop.entries]


def test_an_entry_read_before_a_redis_error_is_handed_over_again_to_be_resumed(client):
    leases = Leases(client, "scheduler-0", "instance", 3.0)
    assert leases.take_own()
    claim_inbox, failures = leases.claim_inbox, [redis.ConnectionError("connection reset by peer")]

    def claim_failing_once_after_a_read(count: int) -> list:
        if failures and client.xpending(redis_keys.REQUEST_STREAM, redis_keys.SCHEDULER_GROUP)["pending"]:
            raise failures.pop()  # the XREADGROUP of this pass just took the entry
        return claim_inbox(count)

    leases.claim_inbox = claim_failing_once_after_a_read
    assert handed_over(client, leases, lambda loop: put(client, "r1")) == [("r1", Delivery.REDELIVERED)]
    assert failures == []  # the error happened, after the read


def test_an_entry_whose_read_reply_was_lost_is_found_by_the_periodic_reread(client, monkeypatch):
    monkeypatch.setattr("pagedserve.services.scheduler.request_reader.BACKLOG_REREAD_S", 0.5)

    def read_with_its_reply_lost(loop: Loop) -> None:
        time.sleep(0.3)  # past the start's read of the backlog
        loop.accepting.clear()  # the reader reads no new entries (after its read under way, up to 200 ms)
        time.sleep(0.5)
        put(client, "r1")
        # what a read whose reply was lost leaves (redis-py retries it, and the retry reads the next entries)
        client.xreadgroup(redis_keys.SCHEDULER_GROUP, "scheduler-0", {redis_keys.REQUEST_STREAM: ">"}, count=1)
        loop.accepting.set()

    leases = Leases(client, "scheduler-0", "instance", 3.0)
    assert leases.take_own()
    assert handed_over(client, leases, read_with_its_reply_lost) == [("r1", Delivery.REDELIVERED)]


def test_the_reader_outlives_a_lost_lease_and_hands_over_what_it_read_once_the_lease_is_back(client):
    """Its lease gone (Redis restarted empty before the watch noticed), the reader's claim of its inbox
    raises OwnLeaseLost after the read took a new entry; the thread must go on, and the entry, in its
    pending list, reaches the loop once the lease is taken again (it used to end the reader: the
    scheduler read nothing more)."""
    leases = Leases(client, "scheduler-0", "instance", 3.0)  # the lease not taken: every inbox claim raises

    def put_then_take_the_lease(loop: Loop) -> None:
        put(client, "r1")
        loop.accepting.set()
        deadline = time.monotonic() + 10
        while not client.xpending(redis_keys.REQUEST_STREAM, redis_keys.SCHEDULER_GROUP)["pending"]:
            assert time.monotonic() < deadline, "the reader did not read r1"
            time.sleep(0.05)
        time.sleep(0.3)  # its inbox claim raised in the same round
        assert leases.take_own()

    assert handed_over(client, leases, put_then_take_the_lease) == [("r1", Delivery.REDELIVERED)]
