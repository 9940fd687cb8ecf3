"""Scheduler and worker leases, take-over of a dead scheduler's requests, and the worker-side fence,
with a real redis-server."""

from __future__ import annotations

import threading
import time

import pytest
import redis

from pagedserve.services.common import redis_keys
from pagedserve.services.common.pb import engine_pb2 as pb
from pagedserve.services.common.signed_records import RecordCheck, RecordKind, sign_record
from pagedserve.services.scheduler.cluster import ClusterWatch
from pagedserve.services.scheduler.commands import ClaimedEntries, ClusterView
from pagedserve.services.scheduler.leases import Leases, OwnLeaseLost
from pagedserve.services.scheduler.queue_consumer import Delivery, RequestQueueConsumer
from pagedserve.services.scheduler.worker_registry import WorkerRegistry
from pagedserve.services.worker.service import LeaseFence, PlanOutOfOrder
from tests.e2e.processes import CLUSTER_TOKEN, RECORDS

TTL_S = 1.0


def register_worker(client: redis.Redis, worker_id: str, num_blocks: int) -> None:
    reg = pb.WorkerRegistration(worker_id=worker_id, address=f"{worker_id}:1", num_blocks=num_blocks, block_size=16,
                                instance_id="i")
    sign_record(reg, CLUSTER_TOKEN)
    client.hset(redis_keys.WORKERS_HASH, worker_id, reg.SerializeToString())
    client.set(redis_keys.worker_heartbeat_key(worker_id), b"1", px=60_000)


class Watcher:
    """A scheduler's ClusterWatch and what it published."""

    def __init__(self, client: redis.Redis, scheduler_id: str) -> None:
        self.views: list[ClusterView] = []
        self.claimed: list[ClaimedEntries] = []
        self.refused: list[RecordKind] = []  # records from Redis its check refused
        self.acked: list[bytes] = []
        self.leases = Leases(client, scheduler_id, f"{scheduler_id}-instance", TTL_S)
        check = RecordCheck(CLUSTER_TOKEN, self.refused.append)
        self.watch = ClusterWatch(client, self.leases, WorkerRegistry(client, check), check,
                                  f"{scheduler_id}:1", TTL_S, self._publish, threading.Event(), self.acked.append)

    def _publish(self, item) -> None:
        (self.views if isinstance(item, ClusterView) else self.claimed).append(item)

    def owned(self) -> set[str]:
        return set(self.views[-1].workers) if self.views else set()


def two_schedulers_with_a_worker_each(client: redis.Redis) -> tuple[Watcher, Watcher]:
    """Workers w0 and w1 registered, schedulers s0 and s1 ticked until each owns one."""
    register_worker(client, "w0", 10)
    register_worker(client, "w1", 10)
    s0, s1 = Watcher(client, "s0"), Watcher(client, "s1")
    for _ in range(3):
        s0.watch.tick()
        s1.watch.tick()
    assert len(s0.owned()) == len(s1.owned()) == 1
    return s0, s1


def test_worker_lease_acquire_renew_release_and_epochs_grow_even_after_redis_restarts_empty(client):
    a, b = Leases(client, "a", "ia", TTL_S), Leases(client, "b", "ib", TTL_S)
    assert a.take_own() and b.take_own()
    first = a.acquire_worker("w")
    assert first > 0 and b.acquire_worker("w") == 0
    assert a.renew_worker("w", first) and not b.renew_worker("w", first)
    assert a.owners(["w", "v"]) == ["a", None]
    b.release_worker("w")  # not b's: nothing happens
    assert a.owners(["w"]) == ["a"]
    a.release_worker("w")
    second = b.acquire_worker("w")
    assert second > first
    assert not a.renew_worker("w", first)  # b owns it now
    client.flushall()  # Redis restarted empty: b keeps it under the same epoch, nobody else having taken it
    assert b.renew_worker("w", second) and a.owners(["w"]) == ["b"]
    with pytest.raises(OwnLeaseLost):  # a's lease went with Redis: it takes no worker until it retakes it
        a.acquire_worker("w")
    assert a.take_own() and a.acquire_worker("w") == 0
    client.flushall()  # and epochs of new owners still grow
    assert a.take_own() and a.acquire_worker("w") > second


def test_taking_the_own_lease_again_renews_it_and_another_instances_lease_is_refused(client):
    """A take whose reply was lost is retried by redis-py: the retry finds the key holding this instance id
    (a plain SET NX answered no, and the scheduler waited a TTL believing another process used its id)."""
    mine, other = Leases(client, "s", "mine", TTL_S), Leases(client, "s", "other", TTL_S)
    assert mine.take_own()
    client.pexpire(redis_keys.scheduler_lease_key("s"), 100)
    assert mine.take_own() and client.pttl(redis_keys.scheduler_lease_key("s")) > 500  # renewed to the TTL
    assert not other.take_own() and client.get(redis_keys.scheduler_lease_key("s")) == b"mine"


def test_a_scheduler_takes_no_worker_under_a_lease_another_instance_holds(client):
    """The lease key holds another instance id (a process restarted under the same name took it):
    this one may not take workers."""
    old, new = Leases(client, "s", "old", TTL_S), Leases(client, "s", "new", TTL_S)
    assert new.take_own()
    with pytest.raises(OwnLeaseLost):
        old.acquire_worker("w")
    assert new.owners(["w"]) == [None] and new.acquire_worker("w") > 0
    with pytest.raises(OwnLeaseLost):
        old.claim_pending("dead", redis_keys.scheduler_lease_key("dead"), 10)


def test_two_schedulers_racing_for_the_same_workers_never_both_win(client):
    contenders = [Leases(client, f"s{i}", f"i{i}", TTL_S) for i in range(4)]
    assert all(c.take_own() for c in contenders)
    for round_ in range(30):
        worker_id = f"w{round_}"
        results: list[int] = [0] * len(contenders)
        start = threading.Barrier(len(contenders))

        def race(i: int) -> None:
            start.wait()
            results[i] = contenders[i].acquire_worker(worker_id)

        threads = [threading.Thread(target=race, args=(i,)) for i in range(len(contenders))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        winners = [i for i, epoch in enumerate(results) if epoch]
        assert len(winners) == 1, results
        assert contenders[0].owners([worker_id]) == [f"s{winners[0]}"]


def test_a_dead_schedulers_requests_are_claimed_once_and_only_after_its_lease_is_gone(client):
    dead = RequestQueueConsumer(client, "dead", RECORDS)
    for rid in ("a", "b"):
        client.xadd(redis_keys.REQUEST_STREAM, {redis_keys.REQUEST_FIELD: RECORDS.sign(pb.QueuedRequest(request_id=rid))})
    assert len(dead.read(count=10, block_ms=10)) == 2
    lease_key = redis_keys.scheduler_lease_key("dead")
    client.set(lease_key, b"alive", px=60_000)
    survivors = [Leases(client, f"s{i}", f"i{i}", TTL_S) for i in range(2)]
    assert all(s.take_own() for s in survivors)
    assert survivors[0].claim_pending("dead", lease_key, 10) == (0, [])  # still alive
    client.delete(lease_key)
    stamped = [s.claim_pending("dead", lease_key, 10) for s in survivors]
    claimed = [entries for _, entries in stamped]
    assert [len(c) for c in claimed] == [2, 0]
    assert abs(stamped[0][0] / 1e6 - time.time()) < 60  # Redis's clock at the claim: the resume queries' stamp
    pending = client.xpending_range(redis_keys.REQUEST_STREAM, redis_keys.SCHEDULER_GROUP, "-", "+", 10)
    assert {p["consumer"] for p in pending} == {b"s0"}


def test_a_scheduler_restarting_under_its_name_reads_its_backlog_only_while_holding_its_lease(client):
    """The lease is taken before the backlog is read, and claims check the lease atomically: the
    restarted scheduler and a survivor never both get an entry."""
    old = RequestQueueConsumer(client, "s0", RECORDS)
    client.xadd(redis_keys.REQUEST_STREAM, {redis_keys.REQUEST_FIELD: RECORDS.sign(pb.QueuedRequest(request_id="a"))})
    assert len(old.read(count=10, block_ms=10)) == 1
    restarted, survivor = Leases(client, "s0", "new", TTL_S), Leases(client, "s1", "i1", TTL_S)
    assert restarted.take_own() and survivor.take_own()
    assert survivor.claim_pending("s0", redis_keys.scheduler_lease_key("s0"), 10) == (0, [])
    backlog = RequestQueueConsumer(client, "s0", RECORDS).read(count=10, block_ms=10)
    assert [e.request.request_id for e in backlog] == ["a"] and backlog[0].delivery is Delivery.REDELIVERED
    assert backlog[0].taken_at_us > 0


def test_unowned_workers_are_shared_out_by_blocks_and_a_dead_schedulers_workers_are_adopted(client):
    for worker_id, blocks in (("w0", 100), ("w1", 100), ("w2", 40)):
        register_worker(client, worker_id, blocks)
    s0, s1 = Watcher(client, "s0"), Watcher(client, "s1")
    for _ in range(3):  # both register, then both see each other and take their share
        s0.watch.tick()
        s1.watch.tick()
    assert s0.owned() | s1.owned() == {"w0", "w1", "w2"} and not s0.owned() & s1.owned()
    assert {len(s0.owned()), len(s1.owned())} == {1, 2}  # 100 blocks vs 140
    assert all(v.epochs[w] > 0 for v in (s0.views[-1], s1.views[-1]) for w in v.workers)
    assert s0.views[-1].peers_have_workers and s1.views[-1].peers_have_workers
    # s0 dies (stops renewing): s1 adopts its workers once their leases expired
    started = time.monotonic()
    while s1.owned() != {"w0", "w1", "w2"}:
        assert time.monotonic() - started < 3 * TTL_S, "the dead scheduler's workers were not adopted"
        time.sleep(0.1)
        s1.watch.tick()
    assert not s1.views[-1].peers_have_workers


def test_a_dead_schedulers_requests_go_to_a_survivor_with_workers(client):
    register_worker(client, "w0", 10)
    survivor = Watcher(client, "s1")
    dead = RequestQueueConsumer(client, "s0", RECORDS)
    client.xadd(redis_keys.REQUEST_STREAM, {redis_keys.REQUEST_FIELD: RECORDS.sign(pb.QueuedRequest(request_id="a"))})
    assert len(dead.read(count=10, block_ms=10)) == 1
    survivor.watch.tick()  # takes its lease and registers
    survivor.watch._claim_after = 0.0  # a TTL later (a peer without a lease may be alive until then)
    survivor.watch.tick()  # takes the worker, then claims (s0 has no lease)
    assert survivor.owned() == {"w0"}
    entries = [e for c in survivor.claimed for e in c.entries]
    assert [e.request.request_id for e in entries] == ["a"] and entries[0].delivery is Delivery.REDELIVERED
    survivor.watch.tick()
    consumers = {c["name"] for c in client.xinfo_consumers(redis_keys.REQUEST_STREAM, redis_keys.SCHEDULER_GROUP)}
    assert b"s0" not in consumers  # forgotten once nothing of it is pending


def test_the_worker_fence_refuses_plans_of_an_older_lease_epoch():
    fence = LeaseFence()
    fence.admit(5)
    fence.admit(5)
    fence.admit(9)
    with pytest.raises(PlanOutOfOrder, match="older than 9"):
        fence.admit(5)
    assert fence.newest_epoch == 9


def test_a_dead_consumer_is_forgotten_only_without_a_lease_and_with_nothing_pending(client):
    s1 = Leases(client, "s1", "i1", TTL_S)
    reg = pb.SchedulerRegistration(scheduler_id="s0", address="s0:1", instance_id="old")
    client.hset(redis_keys.SCHEDULERS_HASH, "s0", reg.SerializeToString())
    s0 = RequestQueueConsumer(client, "s0", RECORDS)
    client.xadd(redis_keys.REQUEST_STREAM, {redis_keys.REQUEST_FIELD: RECORDS.sign(pb.QueuedRequest(request_id="a"))})
    entry = s0.read(count=10, block_ms=10)[0]
    lease_key = redis_keys.scheduler_lease_key("s0")
    assert not s1.forget_consumer("s0", lease_key)  # something pending
    s0.ack(entry.entry_id)
    client.set(lease_key, b"new", px=60_000)  # restarted under the same id
    assert not s1.forget_consumer("s0", lease_key)
    client.delete(lease_key)
    assert s1.forget_consumer("s0", lease_key)
    names = {c["name"] for c in client.xinfo_consumers(redis_keys.REQUEST_STREAM, redis_keys.SCHEDULER_GROUP)}
    assert b"s0" not in names and not client.hexists(redis_keys.SCHEDULERS_HASH, "s0")
