"""The gateway's view of the live schedulers: their registrations in Redis, one ``SchedulerLink``
(an open StreamOutputs call) per live scheduler, and how long each has been unreachable."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable

import redis
import redis.asyncio as aioredis

from pagedserve.services.common import redis_keys
from pagedserve.services.common.limits import MAX_LEASE_TTL_S
from pagedserve.services.common.pb import engine_pb2 as pb
from pagedserve.services.common.scheduler_directory import live_only, scheduler_registrations
from pagedserve.services.common.signed_records import RecordCheck, RecordKind
from pagedserve.services.gateway.scheduler_link import BatchHandler, SchedulerLink

log = logging.getLogger("pagedserve.gateway")

POLL_INTERVAL_S = 0.5
"""How often the gateway reads the scheduler directory from Redis, seconds."""

MAX_LEFT_REMEMBERED = 1024
"""Schedulers that left the directory whose time of leaving is remembered (oldest forgotten first)."""


class SchedulerDiscovery:
    """Keeps one link per live scheduler: a scheduler joins when its registration (hash
    ``redis_keys.SCHEDULERS_HASH``, signed with the cluster token) is there and its lease key holds
    its instance id; it leaves (stream closed, channel dropped) once either is gone and its stream is
    down (an open stream proves it alive: Redis may have restarted empty, and it registers again
    within a tick), or is replaced when its address changes. Unsigned registrations are ignored
    (counted by ``on_refused`` and logged once each).
    While Redis does not answer, the links stay as they are.

    Args:
        client: the gateway's asyncio Redis client.
        cluster_token: verifies registrations and is sent with every call to a scheduler.
        gateway_id: this gateway's id (the StreamOutputs calls ask for its events).
        on_batch: receives every batch of every scheduler, with the scheduler's id.
        poll_interval_s: how often the directory is read, seconds (> 0).
        on_refused: called with the kind of each record refused (the gateway's counter).
    """

    def __init__(self, client: aioredis.Redis, cluster_token: str, gateway_id: str, on_batch: BatchHandler,
                 poll_interval_s: float = POLL_INTERVAL_S,
                 on_refused: Callable[[RecordKind], None] = lambda kind: None) -> None:
        self.links: dict[str, SchedulerLink] = {}
        self._redis = client
        self._token = cluster_token
        self._gateway_id = gateway_id
        self._on_batch = on_batch
        self._interval_s = poll_interval_s
        self._left_at: OrderedDict[str, float] = OrderedDict()  # id -> monotonic time its stream was lost
        self._none_connected_since: float | None = time.monotonic()
        self._registrations = scheduler_registrations(RecordCheck(cluster_token, on_refused))
        self._redis_answers = True
        self.longest_lease_ttl_s = 0.0
        """The longest lease TTL any scheduler has registered since this gateway started (0 before any), seconds:
        how long after a scheduler dies its peers may wait before taking its requests over. It never shrinks (a
        dead scheduler's TTL still bounds its takeover), so one scheduler run with a long TTL lengthens every
        request's wait for a lost stream until the gateway restarts."""

    def connected_links(self) -> list[SchedulerLink]:
        """The links whose stream is open now."""
        return [link for link in self.links.values() if link.connected]

    def describe(self) -> str:
        """The links' states for a log line: ``id (connected|down N.N s)`` each, or ``no scheduler links``."""
        states = [f"{sid} ({'connected' if link.connected else f'down {link.down_for_s():.1f} s'})"
                  for sid, link in self.links.items()]
        return ", ".join(states) or "no scheduler links"

    def none_connected_for_s(self) -> float:
        """Seconds for which no scheduler stream has been open (0 while one is; counted from the
        gateway's start before the first connects)."""
        since = self._none_connected_since
        return 0.0 if since is None else time.monotonic() - since

    def down_for_s(self, scheduler_id: str) -> float:
        """Seconds since the stream of ``scheduler_id`` was lost (0 while open); for a scheduler
        that left the directory, since its stream was lost; ``math.inf`` for one never seen (or
        forgotten, see ``MAX_LEFT_REMEMBERED``)."""
        link = self.links.get(scheduler_id)
        if link is not None:
            return link.down_for_s()
        left_at = self._left_at.get(scheduler_id)
        return math.inf if left_at is None else time.monotonic() - left_at

    async def run(self) -> None:
        """Refreshes the links every ``poll_interval_s`` until cancelled (then closes them all)."""
        try:
            while True:
                await self.refresh()
                await asyncio.sleep(self._interval_s)
        finally:
            await self.close()

    async def refresh(self) -> None:
        """Reads the directory once and opens, replaces or closes links to match it."""
        try:
            live = await self._read_live()
        except redis.RedisError as exc:
            if self._redis_answers:
                log.warning("cannot read the scheduler directory (Redis: %s); keeping %d scheduler link(s)",
                            exc, len(self.links))
            self._redis_answers = False
            return
        self._redis_answers = True
        for scheduler_id, link in list(self.links.items()):
            registration = live.get(scheduler_id)
            moved = registration is not None and registration.address != link.address
            if moved or (registration is None and not link.connected):
                await self._drop(scheduler_id)
        for scheduler_id, registration in live.items():
            self.longest_lease_ttl_s = max(self.longest_lease_ttl_s, min(registration.lease_ttl_s, MAX_LEASE_TTL_S))
            if scheduler_id not in self.links:
                self._add(registration)

    async def close(self) -> None:
        """Closes every link."""
        for scheduler_id in list(self.links):
            await self._drop(scheduler_id)

    async def _read_live(self) -> dict[str, pb.SchedulerRegistration]:
        """The live, verified registrations by scheduler id. Raises ``redis.RedisError``."""
        registrations = self._registrations.verified(await self._redis.hgetall(redis_keys.SCHEDULERS_HASH))
        if not registrations:
            return {}
        leases = await self._redis.mget([redis_keys.scheduler_lease_key(sid) for sid in registrations])
        return live_only(registrations, leases)

    def _add(self, registration: pb.SchedulerRegistration) -> None:
        sid = registration.scheduler_id
        link = SchedulerLink(registration, self._token, self._gateway_id, self._on_batch, self._update_connected,
                             down_since=self._left_at.pop(sid, None))
        self.links[sid] = link
        link.start()
        log.info("scheduler %s at %s joined (instance %s)", sid, registration.address, registration.instance_id)

    async def _drop(self, scheduler_id: str) -> None:
        link = self.links.pop(scheduler_id)
        await link.close()
        self._left_at[scheduler_id] = link.down_since
        self._left_at.move_to_end(scheduler_id)
        if len(self._left_at) > MAX_LEFT_REMEMBERED:
            self._left_at.popitem(last=False)
        log.info("scheduler %s at %s left the directory: its stream is closed", scheduler_id, link.address)

    def _update_connected(self) -> None:
        if any(link.connected for link in self.links.values()):
            self._none_connected_since = None
        elif self._none_connected_since is None:
            self._none_connected_since = time.monotonic()
