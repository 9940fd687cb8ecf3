"""Redis restarted empty under running schedulers (issue #20, defect 1), with a real redis-server:
every lease, registration, stream entry and the consumer group are gone, while the schedulers
still run their requests. Nothing may be lost: no scheduler takes a live peer's worker in the gap
before the peer renews its lease, and a request handed off whose entry Redis forgot is queued again
for a peer to resume."""

from __future__ import annotations

import pytest

from pagedserve.services.common import redis_keys
from pagedserve.services.common.pb import engine_pb2 as pb
from pagedserve.services.scheduler.queue_consumer import Delivery, RequestQueueConsumer
from tests.e2e.processes import RECORDS
from tests.scheduler.test_cluster_failure_orders import pending, queue_request
from tests.scheduler.test_leases import Watcher, register_worker, two_schedulers_with_a_worker_each

pytestmark = pytest.mark.timeout(30)


def restart_redis_empty(client) -> None:
    """FLUSHALL, then the workers register again (their heartbeat) and a reader makes the group again."""
    client.flushall()
    register_worker(client, "w0", 10)
    register_worker(client, "w1", 10)
    RequestQueueConsumer(client, "setup", RECORDS).ensure_group()


def test_after_redis_restarts_empty_no_scheduler_takes_the_worker_a_live_peer_runs(client):
    """The first scheduler to tick after the restart sees its peer's worker unowned (the lease key
    died with Redis) and no peer registration: it used to take the worker, stranding the peer's
    requests (7 and 10 of 16 streams hung in the attack run)."""
    s0, s1 = two_schedulers_with_a_worker_each(client)
    before = (s0.owned(), s1.owned())
    restart_redis_empty(client)
    for _ in range(4):  # s0 ticks first each round; both within the lease TTL of the restart
        s0.watch.tick()
        s1.watch.tick()
    assert (s0.owned(), s1.owned()) == before


def test_redis_restarting_empty_within_a_schedulers_tick_does_not_let_it_take_a_peers_worker(client):
    """s0's tick renewed its lease, then Redis restarted empty, and the same tick read the new Redis:
    s1's worker had registered again (its heartbeat) with no owner key, and s0 took it before it
    noticed its own lease was gone (seen once in CI, in test_redis_restarted_empty_then_a_worker_killed_
    loses_no_stream: s1 was left without a worker and handed its 7 requests to s0)."""
    s0, s1 = two_schedulers_with_a_worker_each(client)
    before = (s0.owned(), s1.owned())
    live_workers = s0.watch._registry.live_workers

    def restart_then_read():  # Redis restarts between this tick's lease renewal and its read of the workers
        restart_redis_empty(client)
        return live_workers()

    s0.watch._registry.live_workers = restart_then_read
    s0.watch.tick()
    s0.watch._registry.live_workers = live_workers
    for _ in range(3):
        s1.watch.tick()
        s0.watch.tick()
    assert (s0.owned(), s1.owned()) == before


def test_redis_restarting_empty_within_a_schedulers_tick_does_not_let_it_claim_a_peers_requests(client):
    """As above, before the workers registered again (so s0 takes none and goes on to its claims); s1 read a
    new request from the new Redis before noticing its own lease was gone: the entry is pending under s1,
    whose lease key and registration Redis forgot. s0 must not claim it, in that tick (its own lease is
    gone: the claim checks it) nor in the ticks before s1 renews (the hold-off): it would move to s0, and
    the gateway would fence s1 off a request it runs."""
    s0, s1 = two_schedulers_with_a_worker_each(client)
    live_workers, entry_id = s0.watch._registry.live_workers, None

    def restart_then_read():
        nonlocal entry_id
        client.flushall()
        RequestQueueConsumer(client, "setup", RECORDS).ensure_group()
        entry_id = queue_request(client, "r")
        assert len(RequestQueueConsumer(client, "s1", RECORDS).read(count=10, block_ms=10)) == 1
        return live_workers()

    s0.watch._claim_after = 0.0  # a TTL after s0 took its lease: only the claim's own check keeps it off
    s0.watch._registry.live_workers = restart_then_read
    s0.watch.tick()
    s0.watch._registry.live_workers = live_workers
    assert s0.claimed == [] and pending(client) == {entry_id: b"s1"}
    register_worker(client, "w0", 10)  # the workers' heartbeats
    register_worker(client, "w1", 10)
    s0.watch.tick()  # s0 takes its lease again; s1 has not ticked yet
    s0.watch.tick()
    assert s0.claimed == [] and pending(client) == {entry_id: b"s1"}
    s1.watch.tick()
    assert pending(client) == {entry_id: b"s1"}


def test_a_fresh_scheduler_claims_no_peers_requests_within_a_ttl_of_taking_its_lease(client):
    """A scheduler started while Redis was down, meeting a Redis just restarted empty: s1's entry is pending
    under s1, whose lease Redis forgot. The newcomer's lease is valid, so only the hold-off keeps it off."""
    s0, s1 = two_schedulers_with_a_worker_each(client)
    restart_redis_empty(client)
    entry_id = queue_request(client, "r")
    assert len(RequestQueueConsumer(client, "s1", RECORDS).read(count=10, block_ms=10)) == 1
    fresh = Watcher(client, "s2")
    for _ in range(3):
        fresh.watch.tick()
    assert fresh.claimed == [] and pending(client) == {entry_id: b"s1"}
    fresh.watch._claim_after = 0.0  # a TTL later, s1 still silent: it is dead, and its request is taken
    fresh.watch.tick()
    assert [e.request.request_id for c in fresh.claimed for e in c.entries] == ["r"]


def test_a_worker_whose_scheduler_died_with_redis_down_is_still_taken_after_the_ttl(client):
    s0, s1 = two_schedulers_with_a_worker_each(client)
    (orphan,) = s1.owned()
    restart_redis_empty(client)  # and s1 is gone: it never ticks again
    s0.watch.tick()
    assert orphan not in s0.owned()
    s0.watch._take_after = 0.0  # a TTL later
    s0.watch.tick()
    s0.watch.tick()
    assert orphan in s0.owned()


def test_a_hand_off_of_entries_redis_forgot_queues_them_again_to_be_resumed(client):
    """s0 runs request r; Redis restarts empty (its entry is gone), then s0 loses its only worker
    and hands r off. The hand-off used to move nothing (no entry) and s0 closed r's route without
    a word: r's client waited until its own deadline. Now r goes on the stream again, marked to be
    resumed (its client has tokens already), so any scheduler with a worker resumes it."""
    queue_request(client, "r")
    s0 = Watcher(client, "s0")
    (entry,) = RequestQueueConsumer(client, "s0", RECORDS).read(count=10, block_ms=10)
    restart_redis_empty(client)
    s0.leases.hand_off([entry])
    (read,) = RequestQueueConsumer(client, "s1", RECORDS).read(count=10, block_ms=10)
    # a new entry, marked to be resumed (the first was FIRST, taken at 0); its id may equal the forgotten
    # one's: an emptied stream's ids start again from the clock, and FLUSHALL takes less than a millisecond
    assert read.request == entry.request and entry.delivery is Delivery.FIRST
    assert read.delivery is Delivery.REDELIVERED and read.taken_at_us > 0
    assert pending(client) == {read.entry_id: b"s1"}


def test_a_hand_off_moves_an_entry_redis_still_holds_and_leaves_one_a_peer_took(client):
    first, second = queue_request(client, "r1"), queue_request(client, "r2")
    entries = RequestQueueConsumer(client, "s0", RECORDS).read(count=10, block_ms=10)
    s0, s1 = Watcher(client, "s0"), Watcher(client, "s1")
    assert s1.leases.take_own()
    s1.leases.claim_pending("s0", redis_keys.scheduler_lease_key("s0"), 1)  # s1 took r1 over (s0 was cut off)
    s0.leases.hand_off(entries)
    assert pending(client) == {first: b"s1", second: redis_keys.HANDOFF_CONSUMER.encode()}
    assert client.xlen(redis_keys.REQUEST_STREAM) == 2  # nothing queued again
    assert [pb.QueuedRequest.FromString(f[redis_keys.REQUEST_FIELD]).request_id
            for _, f in client.xrange(redis_keys.REQUEST_STREAM)] == ["r1", "r2"]
