"""The Redis request stream with a real redis-server: a restarted scheduler re-reads its
unfinished requests once, then goes on to new ones."""

from __future__ import annotations

import pytest
import redis

from pagedserve.services.common import redis_keys
from pagedserve.services.common.pb import engine_pb2 as pb
from pagedserve.services.scheduler.queue_consumer import RequestQueueConsumer
from pagedserve.services.common.signed_records import RecordCheck, RecordKind, sign_record
from tests.e2e.processes import CLUSTER_TOKEN, RECORDS, start_redis


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    process, url = start_redis(tmp_path_factory.mktemp("redis"))
    yield redis.Redis.from_url(url)
    process.stop()


def put(client: redis.Redis, request_id: str) -> None:
    record = RECORDS.sign(pb.QueuedRequest(request_id=request_id, prompt_token_ids=[1]))
    client.xadd(redis_keys.REQUEST_STREAM, {redis_keys.REQUEST_FIELD: record})


def ids(entries) -> list[str]:
    return [e.request.request_id for e in entries]


def test_restart_rereads_unfinished_then_reads_new(client):
    first = RequestQueueConsumer(client, "scheduler-0", RECORDS)
    first.ensure_group()
    for rid in ("a", "b", "c"):
        put(client, rid)
    taken = first.read(count=10, block_ms=100)
    assert ids(taken) == ["a", "b", "c"]
    first.ack(taken[0].entry_id)  # a finished; b and c did not when the scheduler died

    restarted = RequestQueueConsumer(client, "scheduler-0", RECORDS)
    restarted.ensure_group()
    assert ids(restarted.read(count=1, block_ms=100)) == ["b"]  # the backlog, page by page
    assert ids(restarted.read(count=1, block_ms=100)) == ["c"]
    put(client, "d")
    assert ids(restarted.read(count=10, block_ms=100)) == ["d"]  # backlog done: new requests
    assert ids(restarted.read(count=10, block_ms=100)) == []


def test_an_entry_deleted_while_pending_is_dropped(client):
    consumer = RequestQueueConsumer(client, "scheduler-1", RECORDS)
    consumer.ensure_group()
    put(client, "e")
    (entry,) = consumer.read(count=10, block_ms=100)
    client.xdel(redis_keys.REQUEST_STREAM, entry.entry_id)
    again = RequestQueueConsumer(client, "scheduler-1", RECORDS)
    assert again.read(count=10, block_ms=100) == []


def test_a_forged_queued_request_is_dropped_acknowledged_and_counted(client):
    """Issue #20, defect 3: queued requests were not signed; a Redis writer re-queued a client's
    request under its ids with a prompt of its own, and the client got the attacker's answer."""
    refused: list[RecordKind] = []
    consumer = RequestQueueConsumer(client, "scheduler-2", RecordCheck(CLUSTER_TOKEN, refused.append))
    consumer.ensure_group()
    client.delete(redis_keys.REQUEST_STREAM)
    consumer.ensure_group()
    forged = pb.QueuedRequest(request_id="victim", gateway_id="gw-1", prompt_token_ids=[6, 6, 6])
    client.xadd(redis_keys.REQUEST_STREAM, {redis_keys.REQUEST_FIELD: forged.SerializeToString()})
    sign_record(forged, "another-cluster-token-0123456789")
    client.xadd(redis_keys.REQUEST_STREAM, {redis_keys.REQUEST_FIELD: forged.SerializeToString()})
    client.xadd(redis_keys.REQUEST_STREAM, {redis_keys.REQUEST_FIELD: b"\xff not a record"})
    put(client, "genuine")
    assert ids(consumer.read(count=10, block_ms=100)) == ["genuine"]
    assert refused == [RecordKind.QUEUED_REQUEST] * 3
    assert client.xlen(redis_keys.REQUEST_STREAM) == 1  # the forged ones are acknowledged and deleted
    assert client.xpending(redis_keys.REQUEST_STREAM, redis_keys.SCHEDULER_GROUP)["pending"] == 1
