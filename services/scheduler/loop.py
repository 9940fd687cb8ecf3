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
from pagedserve.engine.messages import RequestError, SequenceId
from pagedserve.engine.outputs import RequestOutput
from pagedserve.engine.request_errors import ErrorKind
from pagedserve.engine.scheduler import Scheduler
from services.common.convert import output_to_pb, request_from_pb
from services.common.pb import engine_pb2 as pb
from services.scheduler.cluster import ClaimedEntries, ClusterView, LoadSnapshot
from services.scheduler.commands import Abort, Command, GatewayGone, NewEntries, Resume, StepDone
from services.scheduler.config import SchedulerServiceConfig
from services.scheduler.gateway_presence import GatewayPresence
from services.scheduler.gateway_streams import GatewayStreams
from services.scheduler.grpc_executor import GrpcExecutor
from services.scheduler.membership import WorkerMembership
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.migration import PendingResumes, resume_query, resumed_samples_from_pb
from services.scheduler.queue_consumer import Delivery, QueueEntry
from services.scheduler.redis_io import RedisWrites
from services.scheduler.routes import Routes

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
        self._tracer = tracer
        self._set_ready = set_ready
        self._commands: queue.Queue[Command] = queue.Queue()
        self.acks = redis_writes  # runs on a thread of its own: the loop never waits on Redis
        self.accepting = threading.Event()  # read new requests: this scheduler has workers, or no peer has
        self.accepting.set()
        self.has_workers = threading.Event()  # a worker is admitted (as of the latest ClusterView): claims may run
        self._resumes = PendingResumes()
        self._peers_have_workers = False
        self._no_workers_since: float | None = time.monotonic()
        self._gateways = GatewayPresence(config.gateway_grace_s)
        self._early_aborts: dict[str, float] = {}  # aborted before their entry was read -> when
        self._routes = Routes(scheduler, self.streams, redis_writes.put, self.metrics, tracer)
        self._deliver = self._routes.deliver
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
                self._abort_for_gone_gateways()
                self._hand_off_without_workers()
                self._fail_without_workers()
                self._drop_unanswered_resumes()
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
                self._add(entry)
        elif isinstance(command, Abort):
            command.done.set_result(self._abort(command.request_id, command.sample_index))
        elif isinstance(command, Resume):
            self._resume(command)
        elif isinstance(command, GatewayGone):
            if self.streams.is_current(command.gateway_id, command.generation):  # not replaced by a newer stream
                self._gateways.gone(command.gateway_id)
        else:
            for entry in self._gateways.back(command.gateway_id):
                self._add(entry)
            queries = self._resumes.queries_for(command.gateway_id)
            if queries.resume_queries:  # again: the gateway may have missed them while it reconnected
                self.streams.publish(command.gateway_id, queries)

    def _abort_for_gone_gateways(self) -> None:
        """Aborts the requests of gateways whose stream has been closed longer than the grace period."""
        deadline = time.monotonic() - self.config.gateway_grace_s
        self._early_aborts = {r: t for r, t in self._early_aborts.items() if t >= deadline - 60}
        for gateway_id, parked in self._gateways.expired().items():
            if parked:
                log.info("dropping %d request(s) of gateway %s, which never connected", len(parked), gateway_id)
            for entry in [*parked, *self._resumes.drop_gateway(gateway_id)]:
                self.acks.put(entry.entry_id)
            for request_id in self._routes.of_gateway(gateway_id):
                log.info("aborting %s: its gateway %s is gone", request_id, gateway_id)
                self._abort(request_id)
            self.streams.close(gateway_id)  # after the aborts, whose outputs would make its queue again

    def _fail_without_workers(self) -> None:
        """Fails every waiting request with UNAVAILABLE once no worker has been up for the timeout."""
        since = self._no_workers_since
        if since is None or time.monotonic() - since < self.config.no_worker_timeout_s:
            return
        error = RequestError(ErrorKind.UNAVAILABLE, f"no worker has been available for {self.config.no_worker_timeout_s:g} s; "
                                          "start a worker (pagedserve worker) and retry")
        for request_id in self.scheduler.waiting_requests():
            log.warning("failing %s: no worker is up", request_id)
            self._deliver(self.scheduler.abort_request(request_id, error=error))

    def _add(self, entry: QueueEntry) -> None:
        try:
            request = request_from_pb(entry.request)
        except ValueError as exc:  # a record no gateway of ours writes: drop it, keep serving
            log.error("dropping stream entry %r: %s", entry.entry_id, exc)
            self.acks.put(entry.entry_id)
            return
        held = self._routes.entry_id(request.request_id) or self._resumes.entry_id(request.request_id)
        if held is not None or self.scheduler.has_request(request.request_id):
            if held is not None and held != entry.entry_id:  # another entry of a request in flight (a replay)
                self.acks.put(entry.entry_id)
            return  # already in flight (its own entry read again after a reconnect is kept)
        if self._early_aborts.pop(request.request_id, None) is not None:
            self.acks.put(entry.entry_id)  # its client gave up before we read it
            return
        gateway_id = entry.request.gateway_id
        if not self._gateways.is_live(gateway_id):  # run only once its gateway listens: orphans cost nothing
            self._gateways.park(entry)
            return
        if entry.delivery is Delivery.REDELIVERED:  # its client may have tokens already: ask what it got
            self._resumes.add(entry)
            self.streams.publish(gateway_id, pb.TokenEventBatch(resume_queries=[resume_query(entry)]))
            return
        request = self._routes.open(entry, request)
        self.scheduler.add_request(request)
        self._deliver([RequestOutput.taken(request.request_id)])

    def _resume(self, command: Resume) -> None:
        """Continues a taken-over request after the tokens its client received; ends it instead
        when it moved more often than ``--migration-limit`` or the account does not fit it."""
        message = command.message
        entry = self._resumes.take(message.request_id, message.gateway_id)
        if entry is None:
            command.done.set_result(False)
            return
        request = self._routes.open(entry, request_from_pb(entry.request))  # decoded once already in _add
        if message.num_migrations > self.config.migration_limit:
            command.done.set_result(True)
            self._fail(request.request_id, RequestError(ErrorKind.UNAVAILABLE, (
                f"the request moved {message.num_migrations} times between schedulers, more than "
                f"--migration-limit {self.config.migration_limit}; retry")))
            return
        try:
            self.scheduler.resume_request(request, resumed_samples_from_pb(message))
        except ValueError as exc:  # the gateway's account does not fit the request: it cannot go on exactly
            command.done.set_exception(exc)
            self._fail(request.request_id, RequestError(ErrorKind.INVALID_ARGUMENT, f"cannot resume the request: {exc}"))
            return
        command.done.set_result(True)
        self.metrics.request_migrated(len(request.prompt_token_ids) + sum(len(s.token_ids) for s in message.samples))
        self._routes.close_if_done(request.request_id)  # every sample had finished: nothing to run

    def _fail(self, request_id: str, error: RequestError) -> None:
        """Ends a request that is not in the engine with ``error``."""
        self._deliver([RequestOutput.aborted(request_id, error)])

    def _hand_off_without_workers(self) -> None:
        """Gives every request to the peers when this scheduler has had no worker for
        ``HANDOFF_AFTER_S`` while a peer has: a peer with workers claims and resumes them."""
        since = self._no_workers_since
        if since is None or not self._peers_have_workers or time.monotonic() - since < HANDOFF_AFTER_S:
            return
        entries = self._routes.give_up_all()  # silently: a peer resumes them for the same clients
        entries += [*self._resumes.drop_all(), *self._gateways.take_all_parked()]
        if entries:
            log.warning("no worker for %g s while peers have some: handing %d request(s) to them", HANDOFF_AFTER_S,
                        len(entries))
            self.acks.hand_off(entries)

    def _drop_unanswered_resumes(self) -> None:
        """Drops requests whose gateway did not answer the resume query, telling it (else it waits for ever)."""
        for entry in self._resumes.expired():
            request_id, gateway_id = entry.request.request_id, entry.request.gateway_id
            log.warning("dropping %s: its gateway %s did not answer the resume query", request_id, gateway_id)
            self.acks.put(entry.entry_id)
            error = RequestError(ErrorKind.UNAVAILABLE, "the request was taken over by another scheduler, which got no "
                                              "answer to its resume query in time; retry")
            output = RequestOutput.aborted(request_id, error)
            self.streams.publish(gateway_id, pb.TokenEventBatch(events=[output_to_pb(output)]))

    def _abort(self, request_id: str, sample_index: int | None = None) -> bool:
        """Aborts a request (or one sample); its gateway gets the final ABORT outputs."""
        outputs = (self.scheduler.abort_request(request_id) if sample_index is None
                   else self.scheduler.abort_sample(SequenceId(request_id, sample_index)))
        waiting = self._resumes.drop(request_id) if sample_index is None else None
        if waiting is not None:  # taken over, and its client is gone: nothing to resume
            self.acks.put(waiting.entry_id)
            return True
        if not outputs and request_id not in self._routes and sample_index is None:  # one sample: the rest goes on
            self._early_aborts[request_id] = time.monotonic()
        self._deliver(outputs)
        return bool(outputs)

    # ---- workers -------------------------------------------------------------------------
    def _update_workers(self, view: ClusterView) -> None:
        now = time.monotonic()
        self.model_name = next((r.model for r in view.workers.values()), self.model_name)
        self._peers_have_workers = view.peers_have_workers
        self._deliver(self.membership.sync(view.workers, view.epochs))
        has_workers = bool(self.scheduler.worker_ids)
        self.has_workers.set() if has_workers else self.has_workers.clear()
        if has_workers:
            self._no_workers_since = None
        elif self._no_workers_since is None:
            self._no_workers_since = now
        if has_workers or not view.peers_have_workers:
            self.accepting.set()
        else:
            self.accepting.clear()  # peers with workers read the new requests
        self._set_ready(has_workers)
