"""Review of issues #13 and #20: whoever can write to Redis (no cluster token needed) can forge or garble
the cluster's keys (a worker's epoch or owner key, a consumer name, a scheduler's lease key, its
registration, a queued request); none of it may stop a scheduler's cluster watch or its claims."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from pagedserve.services.common import redis_keys
from pagedserve.services.common.pb import engine_pb2 as pb
from pagedserve.services.common.signed_records import RecordKind
from pagedserve.services.scheduler.leases import Leases
from pagedserve.services.scheduler.queue_consumer import RequestQueueConsumer
from tests.e2e.processes import RECORDS
from tests.scheduler.test_cluster_failure_orders import pending, queue_request
from tests.scheduler.test_leases import TTL_S, Watcher, register_worker, two_schedulers_with_a_worker_each

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("garbage", [b"9223372036854775807", b"1e300", b"not a number"])
def test_a_garbage_epoch_key_never_makes_an_epoch_a_plan_cannot_carry(client, garbage):
    """Whoever can write to Redis (no cluster token needed) can set a worker's epoch key. The next
    owner's epoch then comes back from the script as -2**63 (Lua's double cast to an integer), and
    ``BatchPlan.lease_epoch`` (uint64) refuses it: ``GrpcExecutor.submit`` raises ValueError in the
    scheduler loop, which stops the scheduler process; every scheduler that takes the worker next
    does the same. A non-number makes the script fail, which aborts every cluster tick (no
    ClusterView, no claims) of every scheduler that tries to take the worker."""
    client.set(redis_keys.worker_epoch_key("w"), garbage)
    leases = Leases(client, "s0", "i0", TTL_S)
    assert leases.take_own()
    epoch = leases.acquire_worker("w")
    assert 0 <= epoch < 2**64
    pb.BatchPlan(lease_epoch=epoch)  # what GrpcExecutor.submit does with it


def test_the_cluster_watch_thread_survives_a_garbage_owner_key(client):
    """A worker's owner key holding bytes that are not UTF-8 (anyone who can write to Redis) makes
    ``Leases.owners`` raise UnicodeDecodeError, which ``ClusterWatch.run`` does not catch (only
    RedisError): the watch thread of every scheduler dies silently. The scheduler's lease then
    expires while its loop and request reader go on: peers claim every request it reads and take
    its workers, and it never notices."""
    register_worker(client, "w0", 10)
    client.set(redis_keys.worker_owner_key("w0"), b"\xff\xfe", px=60_000)
    s0 = Watcher(client, "s0")
    stop = threading.Event()
    thread = threading.Thread(target=s0.watch.run, args=(0.1, stop), daemon=True)
    thread.start()
    try:
        time.sleep(3 * TTL_S)
        assert thread.is_alive(), "the cluster watch thread died"
        assert client.get(redis_keys.scheduler_lease_key("s0")) is not None
    finally:
        stop.set()
        thread.join(timeout=5)


def test_a_consumer_name_that_is_not_text_does_not_stop_the_claims(client):
    """A consumer named with bytes that are not UTF-8 (anyone who can write to Redis:
    XGROUP CREATECONSUMER) made every cluster tick fail before claiming: a dead scheduler's
    requests, and hand-offs, were never taken over."""
    register_worker(client, "w0", 10)
    client.xgroup_createconsumer(redis_keys.REQUEST_STREAM, redis_keys.SCHEDULER_GROUP, b"\x00\xff")
    dead = RequestQueueConsumer(client, "zz-dead", RECORDS)
    queue_request(client, "r")
    assert len(dead.read(count=10, block_ms=10)) == 1
    s1 = Watcher(client, "s1")
    s1.watch.tick()  # takes its lease; claims a TTL later (a peer without a lease may be alive until then)
    s1.watch._claim_after = 0.0
    s1.watch.tick()
    assert [e.request.request_id for c in s1.claimed for e in c.entries] == ["r"]


def test_a_forged_scheduler_registration_is_logged_once_not_at_every_tick(client, caplog):
    """Issue #20, defect 9: an entry in the scheduler directory not signed with the cluster token
    was logged at WARNING at every tick (twice a second, by every scheduler) while it stayed."""
    register_worker(client, "w0", 10)
    forged = pb.SchedulerRegistration(scheduler_id="evil", address="127.0.0.1:1", instance_id="i", num_blocks=99)
    client.hset(redis_keys.SCHEDULERS_HASH, "evil", forged.SerializeToString())
    client.set(redis_keys.scheduler_lease_key("evil"), "i")
    s0 = Watcher(client, "s0")
    with caplog.at_level(logging.WARNING, logger="pagedserve"):
        for _ in range(6):
            s0.watch.tick()
    warnings = [r.getMessage() for r in caplog.records if "'evil'" in r.getMessage()]
    assert len(warnings) == 1 and "scheduler registration" in warnings[0], warnings
    assert s0.refused == [RecordKind.SCHEDULER_REGISTRATION]
    assert s0.watch.peer_loads == {}  # and it is no peer


def test_forged_requests_claimed_from_a_dead_consumer_are_dropped(client):
    """Issue #20, defect 3, on the claim path: what a scheduler takes over is checked too."""
    register_worker(client, "w0", 10)
    forged = client.xadd(redis_keys.REQUEST_STREAM, {
        redis_keys.REQUEST_FIELD: pb.QueuedRequest(request_id="victim", prompt_token_ids=[6]).SerializeToString()})
    queue_request(client, "r")
    client.xreadgroup(redis_keys.SCHEDULER_GROUP, "zz-dead", {redis_keys.REQUEST_STREAM: ">"})  # an intruder's
    s1 = Watcher(client, "s1")
    s1.watch.tick()  # takes its lease; claims a TTL later (a peer without a lease may be alive until then)
    s1.watch._claim_after = 0.0
    s1.watch.tick()
    assert [e.request.request_id for c in s1.claimed for e in c.entries] == ["r"]
    assert s1.refused == [RecordKind.QUEUED_REQUEST] and s1.acked == [forged]


def test_requests_of_a_scheduler_whose_lease_key_was_overwritten_are_claimed_by_a_peer(client):
    """Anyone who can write to Redis can overwrite a scheduler's lease key (no cluster token needed).
    The scheduler then cannot renew or retake its lease and stops reading; peers saw a lease key
    and never claimed its pending entries (nor its inbox's), so those requests waited until their
    clients' deadlines (3 and 7 of 16 streams in the re-attack of issue #20). A lease key that does
    not hold the instance id of the owner's signed registration must not keep its entries."""
    s0, s1 = two_schedulers_with_a_worker_each(client)
    entry_id = queue_request(client, "r")
    assert len(RequestQueueConsumer(client, "s0", RECORDS).read(count=10, block_ms=10)) == 1
    client.set(redis_keys.scheduler_lease_key("s0"), b"garbage-instance", px=60_000)
    s1.watch._claim_after = 0.0  # a TTL after s1 took its lease
    s1.watch.tick()
    assert [e.request.request_id for c in s1.claimed for e in c.entries] == ["r"]
    assert pending(client) == {entry_id: b"s1"}


def test_a_live_scheduler_keeps_its_pending_entries(client):
    """The same peer tick leaves alone the entries of a scheduler whose lease holds its instance."""
    s0, s1 = two_schedulers_with_a_worker_each(client)
    entry_id = queue_request(client, "r")
    assert len(RequestQueueConsumer(client, "s0", RECORDS).read(count=10, block_ms=10)) == 1
    s1.watch.tick()
    assert s1.claimed == [] and pending(client) == {entry_id: b"s0"}
