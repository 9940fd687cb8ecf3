"""The scheduler's request reader, on a thread of its own: new entries from the Redis stream, the
requests peers forwarded to this scheduler, and the forwarding of new requests to a peer that caches
more of their prompt (``prefix_index``) or carries a lighter load (``load_balance``)."""

from __future__ import annotations

import logging
import threading
import time

import redis

from pagedserve.services.scheduler.cluster import ClusterWatch
from pagedserve.services.scheduler.commands import NewEntries
from pagedserve.services.scheduler.leases import Leases, OwnLeaseLost
from pagedserve.services.scheduler.load_balance import BALANCE_SLACK, PeerLoads
from pagedserve.services.scheduler.loop import SchedulerLoop
from pagedserve.services.scheduler.prefix_index import PrefixIndex
from pagedserve.services.scheduler.queue_consumer import Delivery, QueueEntry, RequestQueueConsumer

log = logging.getLogger("pagedserve.scheduler")

STREAM_LENGTH_INTERVAL_S = 1.0
"""How often the request stream's length is read for ``pagedserve_redis_stream_length``, seconds."""

READ_BATCH = 256
"""Most entries claimed from the inbox at once."""

NEW_READ_BATCH = 16
"""Most new entries read at once: small reads give every scheduler's reader a share of a burst, and
the load each forwards by stays current."""

BACKLOG_REREAD_S = 30.0
"""How often the reader pages through this scheduler's pending entries again, seconds
(``RequestQueueConsumer.reread_backlog``; also after every Redis error): the bound on how long an entry
Redis gave this scheduler without the loop getting it (a lost reply) waits before it is resumed."""


class RequestReader:
    """Feeds requests to the loop until stopped.

    Reads only while this scheduler holds its lease (before that, a peer may be taking its backlog
    over), and new entries only while the loop accepts new requests (requests forwarded here are
    taken even then: a scheduler without workers hands them off like its own); waits out Redis
    outages.

    Args:
        consumer: this scheduler's consumer of the request stream.
        loop: the scheduler loop (gets ``NewEntries``; its stats give this scheduler's queue).
        watch: the cluster watch (its lease flag, and the peers that run workers).
        leases: forwards entries to peers and claims this scheduler's inbox.
        index: the shared index of cached blocks; None to place by load only
            (``--placement least-loaded``).
    """

    def __init__(self, consumer: RequestQueueConsumer, loop: SchedulerLoop, watch: ClusterWatch, leases: Leases,
                 index: PrefixIndex | None) -> None:
        self._consumer = consumer
        self._loop = loop
        self._watch = watch
        self._leases = leases
        self._index = index
        self._peer_loads = PeerLoads()
        self._stats_seen = loop.stats
        self._kept_unseen = 0  # entries kept since the loop's stats last changed

    def run(self, stop: threading.Event) -> None:
        measured_at, reread_at = 0.0, time.monotonic()
        while not stop.is_set():
            if not self._watch.lease_held.is_set():
                stop.wait(0.1)
                continue
            if time.monotonic() - reread_at >= BACKLOG_REREAD_S:
                self._consumer.reread_backlog()
                reread_at = time.monotonic()
            try:
                if self._loop.model_name and time.monotonic() - measured_at >= STREAM_LENGTH_INTERVAL_S:
                    self._loop.metrics.stream_length.labels(self._loop.model_name).set(self._consumer.length())
                    measured_at = time.monotonic()
                entries: list[QueueEntry] = []
                if self._loop.accepting.is_set():
                    entries = self._forward_to_peers(self._consumer.read(count=NEW_READ_BATCH, block_ms=200))
                else:
                    stop.wait(0.2)
                entries += self._consumer.decode(self._leases.claim_inbox(READ_BATCH), Delivery.FIRST)
            except redis.ResponseError as exc:
                if "NOGROUP" not in str(exc):
                    raise
                log.warning("the request stream's consumer group is gone (Redis restarted empty?); creating it again")
                self._retry_until_stopped(self._consumer.ensure_group, stop)
                continue
            except redis.RedisError as exc:  # entries read before the error are in our pending list
                log.warning("reading the request stream failed: %s", exc)
                self._consumer.reread_backlog()
                stop.wait(1.0)
                continue
            except OwnLeaseLost:  # Redis restarted empty (or we were cut off): the watch takes the lease again
                self._consumer.reread_backlog()  # entries read just before are in our pending list
                stop.wait(0.1)
                continue
            if entries:
                self._loop.submit(NewEntries(tuple(entries)))

    def _forward_to_peers(self, entries: list[QueueEntry]) -> list[QueueEntry]:
        """The entries to run here; a new one goes to the inbox of a peer that caches more of its
        prompt, else of a peer with a lighter load."""
        keep: list[QueueEntry] = []
        stats = self._loop.stats
        if stats is not self._stats_seen:  # the loop took what was kept before into its stats
            self._stats_seen, self._kept_unseen = stats, 0
        own_load = stats.num_waiting + stats.num_running + self._kept_unseen
        for entry in entries:
            if entry.delivery is not Delivery.FIRST:
                keep.append(entry)
                continue
            target = self._peer_for(entry, own_load + len(keep) + 1)
            if target is not None and self._leases.forward(entry.entry_id, target):
                self._peer_loads.forwarded(target)
            else:
                keep.append(entry)
        self._kept_unseen += len(keep)
        return keep

    def _peer_for(self, entry: QueueEntry, own_load: int) -> str | None:
        """The peer a new request goes to (None: run it here): one that caches more of its prompt
        among those whose load stays within the slack of ``own_load`` (this scheduler's, with the
        request), else one with a lighter load."""
        published = self._watch.peer_loads
        if self._index is not None and published:
            loads = self._peer_loads.estimates(published)
            peer = self._index.better_peer(entry.request, loads, own_load + BALANCE_SLACK)
            if peer is not None:
                log.info("forwarding %s to scheduler %s, which caches more of its prompt", entry.request.request_id,
                         peer)
                self._loop.metrics.request_forwarded()
                return peer
        peer = self._peer_loads.lighter_peer(published, own_load)
        if peer is not None:
            log.debug("forwarding %s to scheduler %s, which has a lighter load", entry.request.request_id, peer)
            self._loop.metrics.request_balanced()
        return peer

    @staticmethod
    def _retry_until_stopped(action, stop: threading.Event) -> None:
        """Runs ``action`` until it succeeds (Redis errors are retried every second) or ``stop`` is set."""
        while not stop.is_set():
            try:
                action()
                return
            except redis.RedisError as exc:
                log.warning("Redis: %s; retrying", exc)
                stop.wait(1.0)
