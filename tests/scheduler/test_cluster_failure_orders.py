"""Review of issue #13 (several schedulers): leases, claims and acknowledgements with a real
redis-server, in the failure orders the feature is meant to survive."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from pagedserve.services.common import redis_keys
from pagedserve.services.common.pb import engine_pb2 as pb
from pagedserve.services.scheduler.leases import Leases
from pagedserve.services.scheduler.queue_consumer import QueueEntry, RequestQueueConsumer
from tests.e2e.processes import RECORDS
from tests.scheduler.test_leases import TTL_S, Watcher, register_worker, two_schedulers_with_a_worker_each

pytestmark = pytest.mark.timeout(30)


def queue_request(client, request_id: str) -> bytes:
    return client.xadd(redis_keys.REQUEST_STREAM,
                       {redis_keys.REQUEST_FIELD: RECORDS.sign(pb.QueuedRequest(request_id=request_id))})


def pending(client) -> dict[bytes, bytes]:
    """Entry id -> consumer, of every pending entry."""
    rows = client.xpending_range(redis_keys.REQUEST_STREAM, redis_keys.SCHEDULER_GROUP, "-", "+", 100)
    return {row["message_id"]: row["consumer"] for row in rows}


def test_a_scheduler_whose_workers_are_gone_does_not_claim_back_what_it_handed_off(client):
    """s0's only worker died: its loop drops it at once (the step fails) and, after 2 s without a
    worker while s1 has one, hands its requests off. But s0's cluster watch still holds the lease
    on the dead worker (released only after RELEASE_MISSING_AFTER_S, 10 s), and claims whenever it
    owns a worker lease: it takes the hand-off entries back (seen in the e2e test
    test_a_scheduler_whose_only_worker_dies_hands_its_requests_to_the_peer: 2 ms after handing 13
    requests off, s0 took them back), queries their gateway, hands them off again; when its ticks
    come just before s1's, the entries bounce until the lease is released (the requests stall
    ~10 s, each round a resume query answered found=False). With a worker still registered but
    failing (readmitted between back-offs), the Resume lands and each round counts a migration,
    until --migration-limit fails the requests with UNAVAILABLE, though s1 could have run them."""
    s0, s1 = two_schedulers_with_a_worker_each(client)
    (dead,) = s0.owned()
    queue_request(client, "r")
    entries = RequestQueueConsumer(client, "s0", RECORDS).read(count=10, block_ms=10)
    assert len(entries) == 1
    client.delete(redis_keys.worker_heartbeat_key(dead))  # s0's worker is killed
    client.hdel(redis_keys.WORKERS_HASH, dead)
    s0.leases.hand_off(entries)  # what s0's loop does 2 s later
    s0.watch.tick()
    assert s0.owned() == set()  # s0 knows it has no live worker ...
    assert s0.claimed == [], "s0 took back the request it had just handed off, with no worker to run it"
    s1.watch.tick()
    assert [e.request.request_id for c in s1.claimed for e in c.entries] == ["r"]


def test_a_scheduler_that_lost_its_lease_cannot_acknowledge_an_entry_a_survivor_took_over(client):
    """s0 is cut off longer than the TTL (a pause, a partition) while running a request; s1 claims
    the entry and resumes the request. When s0 comes back, the gateway fences it: it drops s0's
    tokens and sends s0 an Abort; the abort closes s0's route, which acknowledges (XACK + XDEL) the
    entry by id, though s1 holds it now. The entry leaves s1's pending list and the stream: if s1
    dies next, nobody can claim the request and its client fails instead of moving again."""
    entry_id = queue_request(client, "r")
    s0 = RequestQueueConsumer(client, "s0", RECORDS)
    assert len(s0.read(count=10, block_ms=10)) == 1
    s1 = Leases(client, "s1", "i1", TTL_S)
    assert s1.take_own()
    assert len(s1.claim_pending("s0", redis_keys.scheduler_lease_key("s0"), 10)[1]) == 1  # s0's lease is gone
    assert pending(client) == {entry_id: b"s1"}
    s0.ack(entry_id)  # s0's route for r closes (aborted by the gateway, or finished)
    assert pending(client) == {entry_id: b"s1"}, "s0 acknowledged the entry s1 runs: a second failure loses it"
    assert client.xlen(redis_keys.REQUEST_STREAM) == 1


def test_a_hand_off_that_fails_on_a_redis_error_is_made_again():
    """The loop drops the requests it hands off (silently: a peer is to resume them for the same
    clients) and queues the XCLAIM to the hand-off consumer on ``RedisWrites``, which logs a failed
    write and forgets it. After one Redis error (a timeout, a reset connection) the entries stay
    pending under this live scheduler, which will never read them again (it read its backlog at
    start) and whose lease keeps peers off: their gateways wait for ever (the owner's stream is up)
    and the entries stay in Redis until the scheduler restarts."""
    import redis as redis_lib

    from pagedserve.services.scheduler.redis_io import RedisWrites

    calls: list[list[QueueEntry]] = []

    def hand_off(entries: list[QueueEntry]) -> int:
        calls.append(entries)
        if len(calls) == 1:
            raise redis_lib.ConnectionError("Connection reset by peer")
        return 0

    writes = RedisWrites(lambda entry_id: None, hand_off)
    writes.hand_off([QueueEntry(b"1-0", pb.QueuedRequest(request_id="r"))])
    stop = threading.Event()
    thread = threading.Thread(target=writes.run, args=(stop,), daemon=True)
    thread.start()
    time.sleep(2.0)
    stop.set()
    thread.join(timeout=5)
    assert len(calls) >= 2, "the failed hand-off was not made again: its requests are lost"


def test_a_workers_epoch_key_does_not_outlive_the_worker_for_ever(client):
    """``pagedserve:worker:<id>:epoch`` is set without a TTL and never deleted. Worker ids are new
    at every start where none is given (``worker-<uuid>``, docker compose --scale) or are pod names
    (Kubernetes Deployment): one key per worker process ever started stays in Redis for ever."""
    register_worker(client, "w0", 10)
    s0 = Watcher(client, "s0")
    for _ in range(2):
        s0.watch.tick()
    assert s0.owned() == {"w0"}
    s0.watch._release_all()  # a clean stop; the worker goes away too
    client.delete(redis_keys.worker_heartbeat_key("w0"))
    client.hdel(redis_keys.WORKERS_HASH, "w0")
    assert client.pttl(redis_keys.worker_epoch_key("w0")) != -1, "the epoch key has no TTL: it is never removed"


def test_a_scheduler_whose_loop_has_no_worker_admitted_does_not_claim(client):
    """As above, but the dead worker's registration is still there (its heartbeat has not expired
    yet, or the worker is up but unreachable from this scheduler, or fails every step): the loop
    has it in back-off and runs nothing, so the watch must not claim (``can_run``)."""
    register_worker(client, "w0", 10)
    register_worker(client, "w1", 10)
    s0, s1 = Watcher(client, "s0"), Watcher(client, "s1")
    s0.watch._can_run = lambda: False  # what SchedulerLoop.has_workers says while its worker is in back-off
    for _ in range(3):
        s0.watch.tick()
        s1.watch.tick()
    assert len(s0.owned()) == len(s1.owned()) == 1
    queue_request(client, "r")
    entries = RequestQueueConsumer(client, "s0", RECORDS).read(count=10, block_ms=10)
    assert len(entries) == 1
    s0.leases.hand_off(entries)
    s0.watch.tick()
    assert s0.claimed == []
    s1.watch.tick()
    assert [e.request.request_id for c in s1.claimed for e in c.entries] == ["r"]


def test_when_no_scheduler_runs_a_worker_handed_off_requests_are_still_claimed(client):
    """Claiming only with a running worker must not strand hand-off entries when no scheduler runs
    one: then any scheduler claims them (they end after --no-worker-timeout instead of waiting for
    ever), and none counts as a peer to hand off to."""
    s0, s1 = two_schedulers_with_a_worker_each(client)
    queue_request(client, "r")
    entries = RequestQueueConsumer(client, "s0", RECORDS).read(count=10, block_ms=10)
    assert len(entries) == 1
    for worker_id in ("w0", "w1"):  # both workers die
        client.delete(redis_keys.worker_heartbeat_key(worker_id))
        client.hdel(redis_keys.WORKERS_HASH, worker_id)
    s0.leases.hand_off(entries)
    for _ in range(2):
        s0.watch.tick()
        s1.watch.tick()
    assert not s0.views[-1].peers_have_workers and not s1.views[-1].peers_have_workers
    assert [e.request.request_id for w in (s0, s1) for c in w.claimed for e in c.entries] == ["r"]


def test_a_scheduler_that_lost_its_lease_cannot_hand_off_an_entry_a_survivor_took_over(client):
    """Same as the acknowledgement: the hand-off (XCLAIM with min-idle 0) moved the entry from
    whoever held it, so a cut-off scheduler that hands off takes it from the survivor running it
    (which is then fenced off its own request by the gateway once a third scheduler resumes it)."""
    entry_id = queue_request(client, "r")
    taken = RequestQueueConsumer(client, "s0", RECORDS).read(count=10, block_ms=10)
    s0, s1 = Leases(client, "s0", "i0", TTL_S), Leases(client, "s1", "i1", TTL_S)
    assert s1.take_own()
    assert len(s1.claim_pending("s0", redis_keys.scheduler_lease_key("s0"), 10)[1]) == 1
    s0.hand_off(taken)
    assert pending(client) == {entry_id: b"s1"}
    own = queue_request(client, "q")
    s0.hand_off(RequestQueueConsumer(client, "s0", RECORDS).read(count=10, block_ms=10))
    assert pending(client) == {entry_id: b"s1", own: redis_keys.HANDOFF_CONSUMER.encode()}


def test_a_worker_whose_lease_was_lost_is_dropped_as_such_not_as_missing(client, caplog):
    """Issue #20, defect 9: a scheduler that lost a worker's lease kept it until its registration
    timeout and then logged that the registration "has been missing", which was false."""
    from pagedserve.engine.config import SchedulerConfig
    from pagedserve.engine.scheduler import Scheduler
    from pagedserve.services.scheduler.membership import WorkerMembership
    from tests.scheduler.test_membership import Clock, Connections

    register_worker(client, "w0", 10)
    s0 = Watcher(client, "s0")
    for _ in range(2):
        s0.watch.tick()
    assert s0.owned() == {"w0"}
    clock = Clock()
    members = WorkerMembership(Scheduler(SchedulerConfig()), Connections(), gone_after_s=5.0, clock=clock)
    members.sync(s0.views[-1])
    client.set(redis_keys.worker_owner_key("w0"), "s1")  # s0 was cut off; s1 owns w0 now
    client.set(redis_keys.worker_epoch_key("w0"), s0.views[-1].epochs["w0"] + 1)
    s0.watch.tick()
    with caplog.at_level(logging.INFO, logger="pagedserve"):
        for _ in range(3):
            members.sync(s0.views[-1])
            clock.now += 5.0
    dropped = [r.getMessage() for r in caplog.records if "worker w0 dropped" in r.getMessage()]
    assert len(dropped) == 1 and "lease" in dropped[0] and "missing" not in dropped[0], dropped
    assert members.worker_ids == []
