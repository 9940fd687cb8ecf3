"""The scheduler process's main loop: requests in from Redis, plans out to workers, tokens to gateways.

Only the loop thread touches the engine, and it never waits on Redis: other threads (the Redis
reader, the registration watcher, the acknowledger, gRPC handlers, the gRPC callbacks that carry
the workers' answers) talk to it through queues, so a Redis that hangs stalls no token. Each
worker has its own step pipeline: whenever a worker is idle it gets its next plan, and its answer
is applied as soon as it arrives, so a long prefill on one worker never holds back another.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

from opentelemetry import trace

from pagedserve.engine.engine import Engine, SentPlan, StepFailed
from pagedserve.engine.messages import RequestError
from pagedserve.engine.request_errors import ErrorKind
from pagedserve.engine.scheduler import Scheduler
from pagedserve.services.scheduler.cluster import LoadSnapshot
from pagedserve.services.scheduler.commands import (Abort, AbortSample, ClaimedEntries, ClusterView, Command,
                                                    GatewayGone, HeldRequests, NewEntries, Resume, StepDone)
from pagedserve.services.scheduler.config import SchedulerServiceConfig
from pagedserve.services.scheduler.gateway_streams import GatewayStreams
from pagedserve.services.scheduler.grpc_executor import GrpcExecutor
from pagedserve.services.scheduler.membership import WorkerMembership
from pagedserve.services.scheduler.metrics import SchedulerMetrics
from pagedserve.services.scheduler.redis_io import RedisWrites
from pagedserve.services.scheduler.request_intake import RequestIntake
from pagedserve.services.scheduler.request_table import RequestTable

log = logging.getLogger("pagedserve.scheduler")

CACHE_SNAPSHOT_S = 0.5
"""How often the loop copies its cached block hashes for the shared index, seconds."""

HANDOFF_AFTER_S = 2.0
"""How long a scheduler without workers keeps its requests before handing them to peers that have
workers, seconds (a worker reset after a failed step is back within about a second)."""


class SchedulerLoop:
    """Runs the scheduler and connects it to Redis, the workers and the gateways.

    Args:
        set_ready: called with whether any worker is up (the scheduler's readiness).
    """

    def __init__(self, config: SchedulerServiceConfig, scheduler: Scheduler, redis_writes: RedisWrites,
                 tracer: trace.Tracer, set_ready: Callable[[bool], None]) -> None:
        self.config = config
        self.scheduler = scheduler
        self.streams = GatewayStreams()
        self.stats = scheduler.stats()  # the latest snapshot, replaced whole by the loop (others only read it)
        self.model_name = ""  # the workers' model, from their registrations
        self.metrics = SchedulerMetrics(lambda: (self.stats, self.model_name))
        self.executor = GrpcExecutor(config.step_timeout_s, config.cluster_token, self.metrics.observe_plan_size)
        self.engine = Engine(scheduler, self.executor)
        self.membership = WorkerMembership(scheduler, self.executor, config.worker_gone_after_s)
        self._set_ready = set_ready
        self._commands: queue.Queue[Command] = queue.Queue()
        self.redis_writes = redis_writes  # runs on a thread of its own: the loop never waits on Redis
        self.accepting = threading.Event()  # read new requests: this scheduler has workers, or no peer has
        self.accepting.set()
        self.has_workers = threading.Event()  # a worker is admitted (as of the latest ClusterView): claims may run
        self._peers_have_workers = False
        self._no_workers_since: float | None = time.monotonic()  # none of its own (hand-offs)
        self._none_in_cluster_since: float | None = time.monotonic()  # none of its own and no peer with one (failing)
        table = RequestTable(scheduler, self.streams, redis_writes.ack, self.metrics, tracer)
        self.requests = RequestIntake(config, self.engine, table, self.streams, redis_writes, self.metrics)
        self._deliver = table.deliver
        self.error: Exception | None = None
        self._cache_snapshot = LoadSnapshot()
        self._cache_snapshot_at = 0.0

    def cached_load(self) -> LoadSnapshot:
        """Load and cached block hashes, as of the last snapshot (thread-safe)."""
        return self._cache_snapshot

    def _snapshot_cache(self) -> None:
        """Refreshes ``cached_load``'s snapshot every ``CACHE_SNAPSHOT_S``. The block hashes (a walk
        over every cached block) are taken only while a peer runs workers: only such a peer reads
        new requests, and forwards them by this index."""
        now = time.monotonic()
        if now - self._cache_snapshot_at >= CACHE_SNAPSHOT_S:
            digests = self.scheduler.cached_block_digests() if self._peers_have_workers else frozenset()
            self._cache_snapshot = LoadSnapshot(self.stats.num_waiting, self.stats.num_running, digests)
            self._cache_snapshot_at = now

    def submit(self, command: Command) -> None:
        """Hands a command to the loop thread (thread-safe)."""
        self._commands.put(command)

    def run(self, stop: threading.Event) -> None:
        """Loops until ``stop`` is set. An unexpected exception is logged, kept in ``self.error``
        and stops the process."""
        try:
            while not stop.is_set():
                self.requests.drop_for_gone_gateways()
                self._note_workers()
                self._hand_off_without_workers()
                self._fail_without_workers()
                self.requests.drop_unanswered_resumes()
                self._dispatch()
                self._handle_commands(wait_s=0.05)
                self.stats = self.scheduler.stats()
                self._snapshot_cache()
        except Exception as exc:
            log.exception("scheduler loop failed")
            self.error = exc
            stop.set()

    # ---- the step pipelines --------------------------------------------------------------
    def _dispatch(self) -> None:
        """Sends every worker its next plans (``Engine.send_plans``); each answer comes back to
        the loop as a ``StepDone`` command."""
        dispatch = self.engine.send_plans()
        self._deliver(dispatch.outputs)
        for sent in dispatch.sent:
            self.metrics.plan_sent(sent.worker_id, sent.plan, sent.num_ahead)
            sent.answer.add_done_callback(lambda _answer, sent=sent: self.submit(StepDone(sent)))

    def _step_done(self, sent: SentPlan) -> None:
        """Applies a worker's answer once the answers before it are (``Engine.arrived``)."""
        for due in self.engine.arrived(sent):
            self._apply(due)

    def _apply(self, sent: SentPlan) -> None:
        """Applies a worker's answer; a failed step resets the worker (``WorkerMembership.step_failed``)."""
        current = self.engine.is_current(sent)
        try:
            outputs = self.engine.apply(sent)
        except StepFailed as exc:
            outputs = self.membership.step_failed(sent.worker_id, str(exc))
        else:
            if current:
                self.membership.step_succeeded(sent.worker_id)
        self._deliver(outputs)

    # ---- commands ------------------------------------------------------------------------
    def _handle_commands(self, wait_s: float) -> None:
        try:
            command = self._commands.get(timeout=wait_s)
        except queue.Empty:
            return
        while True:
            self._handle(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _handle(self, command: Command) -> None:
        if isinstance(command, StepDone):
            self._step_done(command.sent)
        elif isinstance(command, ClusterView):
            self._update_workers(command)
        elif isinstance(command, (NewEntries, ClaimedEntries)):
            for entry in command.entries:
                self.requests.add(entry)
        elif isinstance(command, Abort):
            command.done.set_result(self.requests.abort(command.request_id))
        elif isinstance(command, AbortSample):
            command.done.set_result(self.requests.abort_sample(command.seq_id))
        elif isinstance(command, HeldRequests):
            command.done.set_result(self.requests.held(command.request_ids))
        elif isinstance(command, Resume):
            self.requests.resume(command)
        elif isinstance(command, GatewayGone):
            self.requests.gateway_gone(command.gateway_id, command.generation)
        else:
            self.requests.gateway_back(command.gateway_id)

    def _note_workers(self) -> None:
        """Notes whether a worker is admitted (readiness, claims), since when none is here, and since when
        none is in the cluster (none here, and no peer announces one), at every turn: a worker dropped for a
        failed step leaves none without a ClusterView (and a scheduler waiting for its lease publishes none)."""
        has_workers = bool(self.scheduler.worker_ids)
        if has_workers != self.has_workers.is_set():
            self.has_workers.set() if has_workers else self.has_workers.clear()
            self._set_ready(has_workers)
        now = time.monotonic()
        if has_workers:
            self._no_workers_since = None
        elif self._no_workers_since is None:
            self._no_workers_since = now
        if has_workers or self._peers_have_workers:
            self._none_in_cluster_since = None
        elif self._none_in_cluster_since is None:
            self._none_in_cluster_since = now

    def _fail_without_workers(self) -> None:
        """Fails with UNAVAILABLE each waiting request that has waited the timeout while no worker was up in the
        cluster. (A scheduler that never had a worker of its own, beside a peer that has one, must not fail the
        request it reads in the second before it learns that the peer's restarted worker is back: it hands it
        off. Nor may a scheduler whose first worker took longer than the timeout to load fail the request it
        reads just before its ClusterView brings that worker: each request gets the whole timeout.)"""
        since, timeout = self._none_in_cluster_since, self.config.no_worker_timeout_s
        if since is None or time.monotonic() - since < timeout:
            return
        error = RequestError(ErrorKind.UNAVAILABLE, f"no worker has been available for {timeout:g} s; "
                                                    "start a worker (pagedserve worker) and retry")
        for request_id in self.requests.table.in_engine_longer_than(self.scheduler.waiting_requests(), timeout):
            log.warning("failing %s: no worker is up", request_id)
            self._deliver(self.scheduler.abort_request(request_id, error=error))

    def _hand_off_without_workers(self) -> None:
        """Gives every request to the peers when this scheduler has had no worker for
        ``HANDOFF_AFTER_S`` while a peer has: a peer with workers claims and resumes them."""
        since = self._no_workers_since
        if since is None or not self._peers_have_workers or time.monotonic() - since < HANDOFF_AFTER_S:
            return
        entries = self.requests.table.give_up_all()  # silently: a peer resumes them for the same clients
        if entries:
            log.warning("no worker for %g s while peers have some: handing %d request(s) to them", HANDOFF_AFTER_S,
                        len(entries))
            self.redis_writes.hand_off(entries)

    # ---- workers -------------------------------------------------------------------------
    def _update_workers(self, view: ClusterView) -> None:
        self.model_name = view.model_name or self.model_name
        self._peers_have_workers = view.peers_have_workers
        self._deliver(self.membership.sync(view))
        self._note_workers()
        if self.scheduler.worker_ids or not view.peers_have_workers:
            self.accepting.set()
        else:
            self.accepting.clear()  # peers with workers read the new requests
