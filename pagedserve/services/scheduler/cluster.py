"""The scheduler's view of the cluster, kept on a thread of its own: its lease and registration,
which workers it owns, and the requests it takes over from schedulers that died or gave them up.

Every ``interval_s`` the watcher:

1. renews this scheduler's lease (takes it again if it was lost) and publishes its registration
   (address, KV blocks of the workers it owns and runs) for gateways and peers; the takes of steps
   2-3 check the lease again in the same Redis step (Redis may restart empty within a tick), and
   none is made for a TTL after a lost lease (nor a claim after any take of the lease);
2. renews the leases of the workers it owns and takes unowned workers: each unowned worker goes to
   the live scheduler with the fewest blocks (every scheduler computes the same assignment from
   the same registrations); one unowned for longer than twice the TTL goes to whoever sees it;
3. claims the pending requests of consumers whose lease is gone and of the hand-off consumer
   (only while its loop runs a worker, or no peer does: a scheduler without workers cannot run them);
4. hands the loop the registrations of its workers, with their lease epochs, and the claimed
   entries (to be resumed from the tokens their clients already received).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import redis

from pagedserve.services.common import redis_keys
from pagedserve.services.common.pb import engine_pb2 as pb
from pagedserve.services.common.scheduler_directory import live_only, scheduler_registrations
from pagedserve.services.common.signed_records import RecordCheck
from pagedserve.services.scheduler.commands import ClaimedEntries, ClusterView
from pagedserve.services.scheduler.leases import Leases, OwnLeaseLost
from pagedserve.services.scheduler.prefix_index import PrefixIndex
from pagedserve.services.scheduler.queue_consumer import Delivery, decode_entries
from pagedserve.services.scheduler.worker_registry import WorkerRegistry
from pagedserve.services.scheduler.worker_shares import workers_to_take

log = logging.getLogger("pagedserve.scheduler")

CLAIM_BATCH = 256
"""Most entries claimed from one consumer per call."""

RELEASE_MISSING_AFTER_S = 10.0
"""An owned worker whose registration has been missing this long is given up, seconds (longer than
the loop's ``worker_gone_after_s``: a gap from a Redis restart keeps the worker and its sequences)."""


@dataclass(frozen=True)
class LoadSnapshot:
    """A scheduler's load, published with its registration.

    Attributes:
        num_waiting: requests waiting in its queue.
        num_running: sequences running on its workers.
        digests: content hashes of the blocks cached on its workers (empty: not shared).
    """

    num_waiting: int = 0
    num_running: int = 0
    digests: frozenset[bytes] = frozenset()


class ClusterWatch:
    """Runs the steps above until stopped.

    Args:
        client: a Redis client (bytes responses).
        leases: this scheduler's lease operations.
        registry: reads the workers' registrations.
        check: signs this scheduler's registration, verifies its peers' and the claimed requests.
        address: host:port where gateways reach this scheduler.
        ttl_s: lease time to live, seconds.
        publish: hands a ``ClusterView`` or ``ClaimedEntries`` to the loop.
        lease_held: set while this scheduler holds its lease (the request reader waits for it).
        ack: acknowledges an entry (claimed entries that cannot be decoded are dropped with it).
        can_run: whether the loop has a worker admitted now (one in back-off after failed steps
            runs nothing either). Only then does the registration announce blocks (peers hand
            requests off only to a scheduler that announces some) and are requests claimed while
            a peer announces some: else a scheduler that handed its requests off would take them
            back and hand them off again (with a worker in back-off, a migration each time).
        index: where the cached blocks are published for peers (None: not shared).
        load: the loop's load and cached block hashes (published with the registration).

    Attributes:
        peer_loads: the live peers that run a worker, with their load (waiting requests plus
            running sequences), read by the request reader to forward new requests to a peer that
            caches more of their prompt or carries less; replaced whole at each tick.
    """

    def __init__(self, client: redis.Redis, leases: Leases, registry: WorkerRegistry, check: RecordCheck,
                 address: str, ttl_s: float, publish: Callable[[ClusterView | ClaimedEntries], None],
                 lease_held: threading.Event, ack: Callable[[bytes], None],
                 can_run: Callable[[], bool] = lambda: True, index: PrefixIndex | None = None,
                 load: Callable[[], LoadSnapshot] = LoadSnapshot) -> None:
        self._client = client
        self._leases = leases
        self._registry = registry
        self._check = check
        self._schedulers = scheduler_registrations(check)
        self._address = address
        self._ttl_s = ttl_s
        self._publish = publish
        self.lease_held = lease_held
        self._ack = ack
        self._can_run = can_run
        self._index = index
        self._load = load
        self.peer_loads: dict[str, int] = {}
        self._owned: dict[str, int] = {}  # worker id -> epoch
        self._unowned_since: dict[str, float] = {}
        self._missing_since: dict[str, float] = {}  # owned workers whose registration is missing -> since when
        self._waiting_logged = False
        self._settled = False
        self._take_after = 0.0  # monotonic time before which no unowned worker is taken (after a lost lease)
        self._claim_after = 0.0  # ... and no peer's request claimed (after any take of the lease: see tick)

    def run(self, interval_s: float, stop: threading.Event) -> None:
        """Ticks every ``interval_s`` seconds until ``stop``; gives the leases up when stopping."""
        while not stop.is_set():
            try:
                self.tick()
            except redis.RedisError as exc:
                log.warning("cluster state not updated (Redis: %s)", exc)
            except Exception:  # garbage in Redis (anyone who can write there): keep the lease and the thread
                log.exception("cluster state not updated")
            stop.wait(interval_s)
        self._release_all()

    def tick(self) -> None:
        """One round of the steps in the module docstring. The first round after taking the lease
        only registers, so that schedulers started together see each other before sharing workers."""
        if not self._hold_own_lease():
            return
        try:
            self._round()
        except OwnLeaseLost:  # Redis restarted empty since the renewal above: take nothing more this tick
            self._lease_lost()

    def _round(self) -> None:
        """Steps 2-4 of the module docstring, under the lease.

        Raises:
            OwnLeaseLost: a take of a worker or of requests found this scheduler's lease gone.
        """
        read_at = time.monotonic()
        workers = self._registry.live_workers()
        registered = self._schedulers.verified(self._client.hgetall(redis_keys.SCHEDULERS_HASH))
        schedulers = self._live_only(registered)
        if self._settled:
            self._keep_and_take_workers(workers, schedulers)
        self._settled = True
        live = {w: workers[w] for w in self._owned if w in workers}  # a missing one is dropped by the loop in time
        runs = bool(live) and self._can_run()  # a worker that died (registration gone, or in back-off) runs nothing
        load = self._load()
        self._register(sum(w.num_blocks for w in live.values()) if runs else 0, load)
        if self._index is not None:
            self._index.publish(load.digests if runs else frozenset())
        me = self._leases.scheduler_id
        self.peer_loads = {sid: reg.num_waiting + reg.num_running for sid, reg in schedulers.items()
                           if sid != me and reg.num_blocks}
        peers = bool(self.peer_loads)  # a live peer runs a worker
        model_name = next((w.model for w in workers.values()), "")  # any live worker's: the cluster's model
        self._publish(ClusterView(live, dict(self._owned), peers, read_at, model_name))
        if runs or not peers:  # never take back what was handed off for want of a worker; when none runs, any may
            self._claim_orphans(schedulers, registered)

    def _hold_own_lease(self) -> bool:
        if self.lease_held.is_set() and self._leases.renew_own():
            return True
        if self.lease_held.is_set():
            self._lease_lost()
        if not self._leases.take_own():
            if not self._waiting_logged:
                log.warning("the id %r is leased by another instance: this scheduler's previous run, killed less "
                            "than %g s ago, or a scheduler running with the same id; waiting for the lease to "
                            "expire (if two run with one id, give each its own --consumer-name)",
                            self._leases.scheduler_id, self._ttl_s)
                self._waiting_logged = True
            return False
        self.lease_held.set()
        # Taken afresh (at start, or again after a loss): if Redis restarted empty just now, peers' leases are
        # gone until their next ticks, so a peer without one may be alive; its requests wait a TTL.
        self._claim_after = time.monotonic() + self._ttl_s
        return True

    def _lease_lost(self) -> None:
        """This scheduler's lease was found gone: the request reader stops until it is taken again (it
        retries every 0.1 s until this clears ``lease_held``), and no unowned worker is taken for a TTL
        (after Redis restarted empty every lease is gone, live peers' too, until their next ticks)."""
        log.warning("this scheduler's lease had expired (Redis restarted, or it was cut off); taking it again, and "
                    "taking no unowned worker or peer's request for %g s while live peers renew theirs", self._ttl_s)
        self.lease_held.clear()
        self._take_after = time.monotonic() + self._ttl_s

    def _live_only(self, registrations: Mapping[str, pb.SchedulerRegistration]) -> dict[str, pb.SchedulerRegistration]:
        """The signed registrations whose lease key holds their instance id."""
        leases = self._client.mget([redis_keys.scheduler_lease_key(s) for s in registrations]) if registrations else []
        return live_only(registrations, leases)

    def _register(self, num_blocks: int, load: LoadSnapshot) -> None:
        reg = pb.SchedulerRegistration(scheduler_id=self._leases.scheduler_id, address=self._address,
                                       instance_id=self._leases.instance_id, num_blocks=num_blocks,
                                       num_waiting=load.num_waiting, num_running=load.num_running,
                                       lease_ttl_s=self._ttl_s)
        self._client.hset(redis_keys.SCHEDULERS_HASH, reg.scheduler_id, self._check.sign(reg))

    def _keep_and_take_workers(self, workers: Mapping[str, pb.WorkerRegistration],
                               schedulers: Mapping[str, pb.SchedulerRegistration]) -> dict[str, str | None]:
        """Renews this scheduler's worker leases and takes its share of the unowned workers (none
        within a TTL of retaking its own lost lease: after Redis restarted empty, every worker looks
        unowned until its owner's next tick renews it, and taking a live peer's worker would strand
        that peer's requests). Returns each live worker's owner as read before taking (``None``: unowned)."""
        now = time.monotonic()
        for worker_id, epoch in list(self._owned.items()):
            missing_since = now if worker_id in workers else self._missing_since.setdefault(worker_id, now)
            if worker_id in workers:
                self._missing_since.pop(worker_id, None)
            if now - missing_since > RELEASE_MISSING_AFTER_S:  # gone: let whoever sees it again take it
                self._leases.release_worker(worker_id)
            elif self._leases.renew_worker(worker_id, epoch):
                continue
            else:
                log.warning("lost the lease on worker %s (another scheduler owns it now)", worker_id)
            del self._owned[worker_id]
            self._missing_since.pop(worker_id, None)
        ids = sorted(workers)
        owners = dict(zip(ids, self._leases.owners(ids)))
        self._unowned_since = {w: self._unowned_since.get(w, now) for w, owner in owners.items() if owner is None}
        if now < self._take_after:  # Redis forgot every lease: a worker unowned now may be a live peer's
            return owners
        stale_before = now - 2 * self._ttl_s
        for worker_id in workers_to_take(self._leases.scheduler_id, owners, workers, schedulers, self._unowned_since,
                                         stale_before):
            epoch = self._leases.acquire_worker(worker_id)
            if epoch:
                self._owned[worker_id] = epoch
                self._unowned_since.pop(worker_id, None)
                log.info("took worker %s (lease epoch %d)", worker_id, epoch)
        return owners

    def _claim_orphans(self, schedulers: Mapping[str, pb.SchedulerRegistration],
                       registered: Mapping[str, pb.SchedulerRegistration]) -> None:
        """Claims the pending entries of consumers without a lease (dead schedulers and their
        inboxes, the hand-off consumer); forgets dead consumers with nothing pending. Within a TTL of
        taking the lease only the hand-off consumer's (a peer without a lease may be alive then)."""
        consumers = self._client.xinfo_consumers(redis_keys.REQUEST_STREAM, redis_keys.SCHEDULER_GROUP)
        held_off = time.monotonic() < self._claim_after
        for consumer in consumers:
            try:
                name = consumer["name"].decode()
            except UnicodeDecodeError:  # no scheduler of ours (its ids are text): someone else's garbage
                continue
            owner = name.removeprefix(redis_keys.INBOX_PREFIX)  # an inbox lives as long as its scheduler
            if owner == self._leases.scheduler_id or owner in schedulers:
                continue
            if held_off and name != redis_keys.HANDOFF_CONSUMER:
                continue
            lease_key = redis_keys.scheduler_lease_key(owner)
            reg = registered.get(owner)
            instance = reg.instance_id if reg is not None else ""  # a lease holding another value is forged
            taken_at_us, claimed = (self._leases.claim_pending(name, lease_key, CLAIM_BATCH, instance)
                                    if consumer["pending"] else (0, []))
            if claimed:
                log.warning("took over %d request(s) of %s, which %s", len(claimed), name,
                            "was handed off" if name == redis_keys.HANDOFF_CONSUMER else "is gone")
                entries = decode_entries(claimed, Delivery.REDELIVERED, self._ack, self._check, taken_at_us)
                self._publish(ClaimedEntries(tuple(entries)))
            elif not consumer["pending"] and name != redis_keys.HANDOFF_CONSUMER:
                self._leases.forget_consumer(name, lease_key)

    def _release_all(self) -> None:
        """A clean stop: gives up the workers and the lease so that peers take over at once."""
        try:
            for worker_id in self._owned:
                self._leases.release_worker(worker_id)
            if self.lease_held.is_set():
                self._leases.release_own()
                self._client.hdel(redis_keys.SCHEDULERS_HASH, self._leases.scheduler_id)
        except redis.RedisError as exc:
            log.warning("could not give the leases up (they expire on their own): %s", exc)
        self._owned.clear()
        self.lease_held.clear()
