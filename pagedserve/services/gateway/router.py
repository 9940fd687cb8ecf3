"""Receives this gateway's token events from every live scheduler and hands each to its request's
queue; tracks which scheduler owns each request and answers the resume queries of request migration."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc
import redis.asyncio as aioredis

from pagedserve.engine.messages import RequestError
from pagedserve.engine.outputs import RequestOutput
from pagedserve.engine.request_errors import ErrorKind
from pagedserve.text.request_samples import ReceivedSample
from pagedserve.services.common.convert import output_from_pb
from pagedserve.services.common.pb import engine_pb2 as pb
from pagedserve.services.common.signed_records import RecordKind
from pagedserve.services.gateway.background import BackgroundCalls
from pagedserve.services.gateway.scheduler_discovery import POLL_INTERVAL_S, SchedulerDiscovery
from pagedserve.services.gateway.scheduler_link import SchedulerLink

log = logging.getLogger("pagedserve.gateway")

MAX_ABORTS_REMEMBERED = 4096
"""Most recent (scheduler, request) pairs aborted for streaming tokens nobody here takes, so each
pair is aborted once."""

CALL_TIMEOUT_S = 30.0
"""Deadline of an Abort or Resume call, seconds."""


@dataclass(frozen=True)
class ResumeQuery:
    """Put in a request's queue when ``scheduler_id`` took the request over: the consumer answers
    with ``OutputRouter.resume`` once it has processed every output queued before it."""

    scheduler_id: str


@dataclass
class _Request:
    queue: asyncio.Queue[RequestOutput | ResumeQuery] = field(default_factory=asyncio.Queue)
    owner: str | None = None   # the scheduler whose events are taken; None until the first event or query
    num_migrations: int = 0    # resumes the owner confirmed
    taken_at_us: int = 0       # stamp of the newest resume query followed (Redis clock, microseconds)
    heard_at: float = field(default_factory=time.monotonic)  # its last event or query (time.monotonic())


class OutputRouter:
    """One table of request queues fed by the StreamOutputs calls of all live schedulers.

    Ownership: the scheduler whose stream delivers a request's first event owns it, and so does
    the one that sent a resume query for it (the request moved). Events of a request from any
    other scheduler are dropped and that scheduler is sent an Abort (this fences a scheduler that
    lost its lease but still streams), as are the tokens of a request nobody here waits for (an
    orphan: its client already left). A resume query for a request nobody here waits for is
    answered with Abort.

    Args:
        client: the gateway's asyncio Redis client (the scheduler directory).
        cluster_token: verifies scheduler registrations; sent with every call.
        gateway_id: this gateway's id, as written in its queued requests.
        on_migrated: called once per resume a scheduler confirmed (the migration counter).
        poll_interval_s: how often the scheduler directory is read, seconds.
        on_refused: called with the kind of each record from Redis refused (the gateway's counter).
    """

    def __init__(self, client: aioredis.Redis, cluster_token: str, gateway_id: str,
                 on_migrated: Callable[[], None] = lambda: None, poll_interval_s: float = POLL_INTERVAL_S,
                 on_refused: Callable[[RecordKind], None] = lambda kind: None) -> None:
        self.discovery = SchedulerDiscovery(client, cluster_token, gateway_id, self._dispatch, poll_interval_s,
                                            on_refused)
        self._gateway_id = gateway_id
        self._on_migrated = on_migrated
        self._requests: dict[str, _Request] = {}
        self._aborted: OrderedDict[tuple[str, str], None] = OrderedDict()
        self.background = BackgroundCalls()
        """Aborts and Resumes sent without waiting (and the generation core's calls of that kind)."""

    async def run(self) -> None:
        """Follows the scheduler directory and streams from every live scheduler until cancelled."""
        await self.discovery.run()

    def register(self, key: str) -> asyncio.Queue[RequestOutput | ResumeQuery]:
        """A queue that receives the outputs of the request with this (gateway-made, unique) key, and
        a ``ResumeQuery`` whenever a scheduler takes the request over (answer it with ``resume``).

        Raises:
            ValueError: the key is registered already (a bug: keys are new per submission).
        """
        if key in self._requests:
            raise ValueError(f"request {key!r} is registered already")
        request = _Request()
        self._requests[key] = request
        return request.queue

    def unregister(self, key: str) -> None:
        """Forgets a finished request; resume queries still queued for it are answered with Abort."""
        self._forget(key)

    def abandon(self, key: str) -> None:
        """Forgets a request that did not finish (its client went away, or it failed) and tells its
        owner (every live scheduler while it has none) to stop it, in the background; resume
        queries still queued for it are answered with Abort."""
        forgotten = self._forget(key)
        if forgotten is None:
            return
        request, asked = forgotten
        if request.owner not in asked:
            self._remember_aborted(request.owner, key)
            self.background.start(self._abort_owned(request.owner, pb.AbortRequest(request_id=key)))

    def _forget(self, key: str) -> tuple[_Request, set[str]] | None:
        """Drops the request and aborts it on each scheduler whose resume query it leaves unanswered
        (each waits for an answer). Returns the request and those schedulers' ids (``None``: unknown key)."""
        request = self._requests.pop(key, None)
        if request is None:
            return None
        asked = set()
        while not request.queue.empty():
            item = request.queue.get_nowait()
            if isinstance(item, ResumeQuery):
                asked.add(item.scheduler_id)
        for scheduler_id in asked:
            self.background.start(self._abort_on(self._link(scheduler_id), pb.AbortRequest(request_id=key)))
        return request, asked

    def quiet_owned(self, scheduler_id: str, quiet_s: float) -> dict[str, float]:
        """The requests ``scheduler_id`` owns that heard nothing from it for ``quiet_s`` seconds: key ->
        when they last did (``time.monotonic()``)."""
        since = time.monotonic() - quiet_s
        return {key: r.heard_at for key, r in self._requests.items() if r.owner == scheduler_id and r.heard_at <= since}

    def end_unheld(self, key: str, scheduler_id: str, heard_at: float) -> None:
        """Ends a request its owner ``scheduler_id`` no longer holds: its call fails with UNAVAILABLE
        (unless it heard from its owner after ``heard_at`` meanwhile, or has another owner)."""
        request = self._requests.get(key)
        if request is not None and request.owner == scheduler_id and request.heard_at == heard_at:
            error = RequestError(ErrorKind.UNAVAILABLE, f"scheduler {scheduler_id} no longer holds the request (its "
                                                        "last output was lost); retry")
            request.queue.put_nowait(RequestOutput.aborted(key, error))

    @property
    def num_in_flight(self) -> int:
        return len(self._requests)

    def unreachable_for_s(self, key: str) -> float:
        """Seconds the request has been without a scheduler to stream it: since its owner's stream
        was lost, or, before it has an owner, since no scheduler stream at all was open (0 when
        one is open)."""
        request = self._requests.get(key)
        if request is None or request.owner is None:
            return self.discovery.none_connected_for_s()
        return self.discovery.down_for_s(request.owner)

    def owner_of(self, key: str) -> str | None:
        """The scheduler whose events the request takes (``None`` before its first event or query, or unknown)."""
        request = self._requests.get(key)
        return None if request is None else request.owner

    async def abort_sample(self, key: str, sample_index: int) -> None:
        """Asks the request's owner (every live scheduler while it has none) to stop one sample of
        the request and free its blocks (the other samples go on); errors are logged."""
        request = self._requests.get(key)
        await self._abort_owned(request.owner if request is not None else None,
                                pb.AbortRequest(request_id=key, sample_index=sample_index))

    def resume(self, key: str, query: ResumeQuery, received: Sequence[ReceivedSample]) -> None:
        """Answers ``query`` in the background: ``Resume`` with the samples the client ``received``
        and the request's migration count plus one. Errors are logged; a failed call leaves the
        request waiting (the scheduler asks again when this gateway's stream is back)."""
        request = self._requests.get(key)
        if request is None:  # unregistered meanwhile: nobody waits for it
            self.background.start(self._abort_on(self._link(query.scheduler_id), pb.AbortRequest(request_id=key)))
            return
        message = pb.ResumeRequest(request_id=key, gateway_id=self._gateway_id,
                                   num_migrations=request.num_migrations + 1)
        message.samples.extend(pb.ResumedSample(sample_index=s.sample_index, token_ids=s.token_ids,
                                                finished=s.finished) for s in received)
        self.background.start(self._send_resume(query.scheduler_id, request, message))

    def _dispatch(self, scheduler_id: str, batch: pb.TokenEventBatch) -> None:
        for event in batch.events:
            self._route_event(scheduler_id, event)
        for query in batch.resume_queries:
            key = query.request_id
            request = self._requests.get(key)
            if request is None:
                log.info("scheduler %s took over %s, which no call here waits for: aborting it", scheduler_id, key)
                self.background.start(self._abort_on(self._link(scheduler_id), pb.AbortRequest(request_id=key)))
                continue
            if query.taken_at_us < request.taken_at_us:  # sent before another scheduler took the request over
                log.info("ignoring scheduler %s's stale resume query for %s", scheduler_id, key)
                continue
            request.taken_at_us = query.taken_at_us
            if request.owner != scheduler_id:
                log.info("request %s moves from scheduler %s to %s", key, request.owner, scheduler_id)
            request.owner, request.heard_at = scheduler_id, time.monotonic()
            request.queue.put_nowait(ResumeQuery(scheduler_id))

    def _route_event(self, scheduler_id: str, event: pb.TokenEvent) -> None:
        key = event.request_id
        request = self._requests.get(key)
        if request is not None and request.owner is None:
            request.owner = scheduler_id
        if request is not None and request.owner == scheduler_id:
            request.heard_at = time.monotonic()
            request.queue.put_nowait(output_from_pb(event))
        elif not event.finish_reason and (scheduler_id, key) not in self._aborted:
            why = "no call waits for its tokens" if request is None else f"scheduler {request.owner} owns it"
            log.info("aborting %s on scheduler %s: %s", key, scheduler_id, why)
            self._remember_aborted(scheduler_id, key)
            self.background.start(self._abort_on(self._link(scheduler_id), pb.AbortRequest(request_id=key)))

    def _link(self, scheduler_id: str | None) -> SchedulerLink | None:
        return None if scheduler_id is None else self.discovery.links.get(scheduler_id)

    def _remember_aborted(self, scheduler_id: str | None, key: str) -> None:
        for sid in [scheduler_id] if scheduler_id is not None else list(self.discovery.links):
            self._aborted[(sid, key)] = None
            if len(self._aborted) > MAX_ABORTS_REMEMBERED:
                self._aborted.popitem(last=False)

    async def _abort_owned(self, owner: str | None, message: pb.AbortRequest) -> None:
        """Sends ``message`` (a whole request, or one sample when ``sample_index`` is set) to
        ``owner`` when it has a link, else to every live scheduler."""
        link = self._link(owner)
        targets = [link] if link is not None else list(self.discovery.links.values())
        await asyncio.gather(*(self._abort_on(t, message) for t in targets))

    async def _abort_on(self, link: SchedulerLink | None, message: pb.AbortRequest) -> None:
        """Sends ``message``; when it fails, or the scheduler did not hold the request (it may still
        read it from Redis), the pair is no longer remembered as aborted, so that the next token the
        scheduler streams for it is answered with another Abort instead of being dropped."""
        if link is None:
            return
        key = message.request_id
        try:
            found = (await link.stub.Abort(message, timeout=CALL_TIMEOUT_S)).found
        except grpc.RpcError as exc:
            log.warning("abort of %s on scheduler %s failed: %s", key, link.scheduler_id, exc.code())
            found = False
        if not found and not message.HasField("sample_index"):
            self._aborted.pop((link.scheduler_id, key), None)

    async def _send_resume(self, scheduler_id: str, request: _Request, message: pb.ResumeRequest) -> None:
        link = self._link(scheduler_id)
        if link is None:
            log.warning("cannot resume %s: scheduler %s left the directory", message.request_id, scheduler_id)
            return
        try:
            reply = await link.stub.Resume(message, timeout=CALL_TIMEOUT_S)
        except grpc.RpcError as exc:
            log.warning("resume of %s on scheduler %s failed (%s); it waits for the query again",
                        message.request_id, scheduler_id, exc.code())
            return
        if not reply.found:
            log.info("scheduler %s no longer waited for the resume of %s", scheduler_id, message.request_id)
            return
        request.num_migrations = max(request.num_migrations, message.num_migrations)
        self._on_migrated()
        log.info("request %s resumed on scheduler %s (migration %d)", message.request_id, scheduler_id,
                 message.num_migrations)
