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
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, replace

import grpc
from opentelemetry import trace

from pagedserve.engine.messages import RequestError, RequestOutput
from pagedserve.engine.scheduler import Scheduler
from services.common import telemetry
from services.common.convert import output_to_pb, request_from_pb
from services.common.pb import engine_pb2 as pb
from services.scheduler.config import SchedulerServiceConfig
from services.scheduler.gateway_streams import GatewayStreams
from services.scheduler.grpc_executor import GrpcExecutor, StepDone
from services.scheduler.membership import WorkerMembership
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.queue_consumer import QueueEntry
from services.scheduler.redis_io import Acknowledger

log = logging.getLogger("pagedserve.scheduler")

UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]


@dataclass(frozen=True)
class NewEntries:
    entries: tuple[QueueEntry, ...]


@dataclass(frozen=True)
class Abort:
    """Abort a request, or only one of its samples when ``sample_index`` is set."""

    request_id: str
    sample_index: int | None
    done: Future


@dataclass(frozen=True)
class GatewayGone:
    """A gateway's output stream (subscription ``generation``) closed; unless a newer one is open,
    its requests are aborted unless it returns in time."""

    gateway_id: str
    generation: int


@dataclass(frozen=True)
class GatewayBack:
    gateway_id: str
    generation: int


@dataclass(frozen=True)
class Registrations:
    """The live workers' registrations, as just read from Redis."""

    live: Mapping[str, pb.WorkerRegistration]


Command = NewEntries | Abort | GatewayGone | GatewayBack | StepDone | Registrations


@dataclass
class _Route:
    """Where a request came from and where its tokens go."""

    gateway_id: str
    entry_id: bytes
    span: trace.Span


class SchedulerLoop:
    """Runs the scheduler and connects it to Redis, the workers and the gateways.

    Args:
        set_ready: called with whether any worker is up (the scheduler's readiness).
    """

    def __init__(self, config: SchedulerServiceConfig, scheduler: Scheduler, ack: Callable[[bytes], None],
                 tracer: trace.Tracer, set_ready: Callable[[bool], None]) -> None:
        self.config = config
        self.scheduler = scheduler
        self.streams = GatewayStreams()
        self.executor = GrpcExecutor(config.step_timeout_s, config.cluster_token, self.submit)
        self.membership = WorkerMembership(scheduler, self.executor, config.worker_gone_after_s)
        self._tracer = tracer
        self._set_ready = set_ready
        self._commands: queue.Queue[Command] = queue.Queue()
        self.acks = Acknowledger(ack)  # runs on a thread of its own: the loop never waits on Redis
        self._routes: dict[str, _Route] = {}
        self._in_flight: dict[str, int] = {}  # worker session id -> plans sent and not yet answered
        self._no_workers_since: float | None = time.monotonic()
        self._gateways_gone: dict[str, float] = {}  # gateway id -> monotonic time its stream closed
        self._gateways_live: set[str] = set()
        self._parked: dict[str, dict[str, QueueEntry]] = {}  # gateway id -> request id -> entry read before it connected
        self._early_aborts: dict[str, float] = {}  # aborted before their entry was read -> when
        self.stats = scheduler.stats()  # the latest snapshot, replaced whole by the loop (others only read it)
        self.model_name = ""  # the workers' model, from their registrations
        self.metrics = SchedulerMetrics(lambda: (self.stats, self.model_name))
        self.error: Exception | None = None

    def submit(self, command: Command) -> None:
        """Hands a command to the loop thread (thread-safe)."""
        self._commands.put(command)

    def run(self, stop: threading.Event) -> None:
        """Loops until ``stop`` is set. An unexpected exception is logged, kept in ``self.error``
        and stops the process."""
        try:
            while not stop.is_set():
                self._abort_for_gone_gateways()
                self._fail_without_workers()
                self._dispatch()
                self._handle_commands(wait_s=0.05)
                self.stats = self.scheduler.stats()
        except Exception as exc:
            log.exception("scheduler loop failed")
            self.error = exc
            stop.set()

    # ---- the step pipelines --------------------------------------------------------------
    def _dispatch(self) -> None:
        """Sends every worker plans until it has ``max_plans_in_flight`` unanswered (with 2, the
        next plan is on its way while the worker runs the current one)."""
        most = self.scheduler.config.max_plans_in_flight
        for _ in range(most):
            room = [w for w in self.scheduler.worker_ids if self._in_flight.get(self.scheduler.session_id(w), 0) < most]
            if not room or not self.scheduler.has_work():
                return
            scheduled = self.scheduler.schedule(room)
            self._deliver(list(scheduled.outputs))
            self.metrics.plans_sent(scheduled.plans)
            for worker_id, plan in scheduled.plans.items():
                unanswered = self._in_flight.get(plan.session_id, 0)
                self._in_flight[plan.session_id] = unanswered + 1
                self.metrics.plan_encoded(worker_id, self.executor.submit(worker_id, plan), unanswered)
            if not scheduled.plans:
                return

    def _step_done(self, done: StepDone) -> None:
        left = self._in_flight.pop(done.session_id, 0) - 1
        if left > 0:
            self._in_flight[done.session_id] = left
        if done.session_id != self.scheduler.session_id(done.worker_id):
            return  # an answer from a session that was reset meanwhile (the worker failed or restarted)
        if done.result is None:
            self._deliver(self.membership.step_failed(done.worker_id, done.error))
            return
        self.membership.step_succeeded(done.worker_id)
        self._deliver(self.scheduler.update_from_output({done.worker_id: done.result}))

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
            self._step_done(command)
        elif isinstance(command, Registrations):
            self._update_workers(command.live)
        elif isinstance(command, NewEntries):
            for entry in command.entries:
                self._add(entry)
        elif isinstance(command, Abort):
            command.done.set_result(self._abort(command.request_id, command.sample_index))
        elif isinstance(command, GatewayGone):
            if self.streams.is_current(command.gateway_id, command.generation):  # not replaced by a newer stream
                self._gateways_live.discard(command.gateway_id)
                self._gateways_gone[command.gateway_id] = time.monotonic()
        else:
            self._gateways_live.add(command.gateway_id)
            self._gateways_gone.pop(command.gateway_id, None)
            for entry in self._parked.pop(command.gateway_id, {}).values():
                self._add(entry)

    def _abort_for_gone_gateways(self) -> None:
        """Aborts the requests of gateways whose stream has been closed longer than the grace period."""
        deadline = time.monotonic() - self.config.gateway_grace_s
        self._early_aborts = {r: t for r, t in self._early_aborts.items() if t >= deadline - 60}
        for gateway_id in [g for g, since in self._gateways_gone.items() if since < deadline]:
            del self._gateways_gone[gateway_id]
            self.streams.close(gateway_id)
            parked = self._parked.pop(gateway_id, {})
            if parked:
                log.info("dropping %d request(s) of gateway %s, which never connected", len(parked), gateway_id)
            for entry in parked.values():
                self.acks.put(entry.entry_id)
            for request_id in [r for r, route in self._routes.items() if route.gateway_id == gateway_id]:
                log.info("aborting %s: its gateway %s is gone", request_id, gateway_id)
                self._abort(request_id)

    def _fail_without_workers(self) -> None:
        """Fails every waiting request with UNAVAILABLE once no worker has been up for the timeout."""
        since = self._no_workers_since
        if since is None or time.monotonic() - since < self.config.no_worker_timeout_s:
            return
        error = RequestError(UNAVAILABLE, f"no worker has been available for {self.config.no_worker_timeout_s:g} s; "
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
        if request.request_id in self._routes or self.scheduler.has_request(request.request_id):
            return  # already in flight (read again after a reconnect)
        if self._early_aborts.pop(request.request_id, None) is not None:
            self.acks.put(entry.entry_id)  # its client gave up before we read it
            return
        gateway_id = entry.request.gateway_id
        if gateway_id not in self._gateways_live:  # run only once its gateway listens: orphans cost nothing
            self._gateways_gone.setdefault(gateway_id, time.monotonic())  # dropped unless it connects in time
            self._parked.setdefault(gateway_id, {})[request.request_id] = entry
            return
        span = self._tracer.start_span(
            "scheduler.request", context=telemetry.extract(request.trace_context),
            attributes={"request_id": request.request_id, "prompt_tokens": len(request.prompt_token_ids)},
        )
        request = replace(request, trace_context=telemetry.inject(trace.set_span_in_context(span)))
        self._routes[request.request_id] = _Route(gateway_id, entry.entry_id, span)
        self.scheduler.add_request(request)
        self.metrics.request_added(request.request_id)
        self._deliver([RequestOutput(request.request_id, 0, ())])  # taken: the gateway stops watching Redis

    def _abort(self, request_id: str, sample_index: int | None = None) -> bool:
        """Aborts a request (or one sample); its gateway gets the final ABORT outputs."""
        outputs = self.scheduler.abort_request(request_id, sample_index)
        if not outputs and request_id not in self._routes:
            self._early_aborts[request_id] = time.monotonic()
        self._deliver(outputs)
        return bool(outputs)

    # ---- outputs -------------------------------------------------------------------------
    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Sends outputs to their gateways, one batch per gateway; closes the routes of requests
        that have no sample left in flight (after the whole batch, so that every sample's last
        output goes out)."""
        batches: dict[str, list[pb.TokenEvent]] = {}
        self.metrics.outputs(outputs)
        for output in outputs:
            route = self._routes.get(output.request_id)
            if route is None:
                continue
            batches.setdefault(route.gateway_id, []).append(output_to_pb(output))
            if output.first_output_index == 0 and output.new_token_ids:
                route.span.add_event("first_token")
            if output.finished:
                route.span.add_event("sample_finished", {"finish_reason": output.finish_reason.value})
        for request_id in {o.request_id for o in outputs}:
            if request_id in self._routes and not self.scheduler.has_request(request_id):
                self._close(self._routes.pop(request_id))
                self.metrics.request_closed(request_id)
        for gateway_id, events in batches.items():
            self.streams.publish(gateway_id, pb.TokenEventBatch(events=events))

    def _close(self, route: _Route) -> None:
        route.span.end()
        self.acks.put(route.entry_id)

    # ---- workers -------------------------------------------------------------------------
    def _update_workers(self, live: Mapping[str, pb.WorkerRegistration]) -> None:
        now = time.monotonic()
        self.model_name = next((r.model for r in live.values()), self.model_name)
        self._deliver(self.membership.sync(live))
        has_workers = bool(self.scheduler.worker_ids)
        if has_workers:
            self._no_workers_since = None
        elif self._no_workers_since is None:
            self._no_workers_since = now
        self._set_ready(has_workers)
