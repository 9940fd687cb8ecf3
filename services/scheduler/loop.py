"""The scheduler process's main loop: requests in from Redis, plans out to workers, tokens to gateways.

Only the loop thread touches the engine. Other threads (the Redis reader, gRPC handlers) talk to
it through a queue of commands.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from collections.abc import Callable
from dataclasses import dataclass, replace

from opentelemetry import trace

from services.common import telemetry
from services.common.convert import output_to_pb, request_from_pb
from pagedserve.engine.messages import RequestOutput
from services.common.pb import engine_pb2 as pb
from pagedserve.engine.config import SchedulerStats
from services.scheduler.config import SchedulerServiceConfig
from pagedserve.engine.engine import Engine
from services.scheduler.gateway_streams import GatewayStreams
from services.scheduler.grpc_executor import GrpcExecutor
from services.scheduler.queue_consumer import QueueEntry
from services.scheduler.worker_registry import WorkerRegistry

log = logging.getLogger("pagedserve.scheduler")


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
    """A gateway's output stream closed; its requests are aborted unless it returns in time."""

    gateway_id: str


@dataclass(frozen=True)
class GatewayBack:
    gateway_id: str


@dataclass
class _Route:
    """Where a request came from and where its tokens go."""

    gateway_id: str
    entry_id: bytes
    span: trace.Span


class SchedulerLoop:
    """Runs the engine and connects it to Redis, the workers and the gateways."""

    def __init__(
        self,
        config: SchedulerServiceConfig,
        engine: Engine,
        executor: GrpcExecutor,
        registry: WorkerRegistry,
        ack: Callable[[bytes], None],
        tracer: trace.Tracer,
    ) -> None:
        self.config = config
        self.engine = engine
        self.streams = GatewayStreams()
        self._executor = executor
        self._registry = registry
        self._ack = ack
        self._tracer = tracer
        self._commands: queue.Queue = queue.Queue()
        self._routes: dict[str, _Route] = {}
        self._added_workers: set[str] = set()
        self._dead_workers: set[str] = set()  # failed a step; not taken back under the same id
        self._next_worker_poll = 0.0
        self._gateways_gone: dict[str, float] = {}  # gateway id -> monotonic time its stream closed
        self._gateways_live: set[str] = set()
        self._early_aborts: dict[str, float] = {}  # aborted before their entry was read -> when
        self.stats: SchedulerStats = engine.scheduler.stats()
        self.error: Exception | None = None

    def submit(self, command: NewEntries | Abort | GatewayGone | GatewayBack) -> None:
        """Hands a command to the loop thread (thread-safe)."""
        self._commands.put(command)

    def run(self, stop: threading.Event) -> None:
        """Loops until ``stop`` is set: schedule, execute, apply, deliver.

        An unexpected exception is logged, kept in ``self.error`` and stops the process.
        """
        try:
            self._run(stop)
        except Exception as exc:
            log.exception("scheduler loop failed")
            self.error = exc
            stop.set()

    def _run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            self._poll_workers()
            self._abort_for_gone_gateways()
            busy = self.engine.has_work() and bool(self.engine.scheduler.worker_ids)
            self._handle_commands(wait_s=0.0 if busy else 0.05)
            if busy:
                self._deliver(self.engine.step())
                self.stats = self.engine.scheduler.stats()

    # ---- commands ------------------------------------------------------------------------
    def _handle_commands(self, wait_s: float) -> None:
        try:
            command = self._commands.get(timeout=wait_s) if wait_s else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
        self.stats = self.engine.scheduler.stats()

    def _handle(self, command: NewEntries | Abort | GatewayGone | GatewayBack) -> None:
        if isinstance(command, NewEntries):
            for entry in command.entries:
                self._add(entry)
        elif isinstance(command, Abort):
            command.done.set_result(self._abort(command.request_id, command.sample_index))
        elif isinstance(command, GatewayGone):
            self._gateways_live.discard(command.gateway_id)
            self._gateways_gone[command.gateway_id] = time.monotonic()
        else:
            self._gateways_live.add(command.gateway_id)
            self._gateways_gone.pop(command.gateway_id, None)

    def _abort_for_gone_gateways(self) -> None:
        """Aborts the requests of gateways whose stream has been closed longer than the grace period."""
        deadline = time.monotonic() - self.config.gateway_grace_s
        self._early_aborts = {r: t for r, t in self._early_aborts.items() if t >= deadline - 60}
        for gateway_id in [g for g, since in self._gateways_gone.items() if since < deadline]:
            del self._gateways_gone[gateway_id]
            self.streams.close(gateway_id)
            for request_id in [r for r, route in self._routes.items() if route.gateway_id == gateway_id]:
                log.info("aborting %s: its gateway %s is gone", request_id, gateway_id)
                self._abort(request_id)

    def _add(self, entry: QueueEntry) -> None:
        request = request_from_pb(entry.request)
        if request.request_id in self._routes:
            return  # already in flight (read again after a reconnect)
        if self._early_aborts.pop(request.request_id, None) is not None:
            self._ack(entry.entry_id)  # its client gave up before we read it
            return
        gateway_id = entry.request.gateway_id
        if gateway_id not in self._gateways_live:
            self._gateways_gone.setdefault(gateway_id, time.monotonic())  # aborted unless it connects in time
        span = self._tracer.start_span(
            "scheduler.request", context=telemetry.extract(request.trace_context),
            attributes={"request_id": request.request_id, "prompt_tokens": len(request.prompt_token_ids)},
        )
        request = replace(request, trace_context=telemetry.inject(trace.set_span_in_context(span)))
        self._routes[request.request_id] = _Route(entry.request.gateway_id, entry.entry_id, span)
        self.engine.add_request(request)

    def _abort(self, request_id: str, sample_index: int | None = None) -> bool:
        found = self.engine.abort_request(request_id, sample_index)
        if not found and request_id not in self._routes:
            self._early_aborts[request_id] = time.monotonic()
        if sample_index is not None and self.engine.scheduler.has_request(request_id):
            return found  # other samples go on
        route = self._routes.pop(request_id, None)
        if route is not None:
            route.span.add_event("aborted")
            self._close(route)
        return found

    # ---- outputs -------------------------------------------------------------------------
    def _deliver(self, outputs: list[RequestOutput]) -> None:
        batches: dict[str, list[pb.TokenEvent]] = {}
        for output in outputs:
            route = self._routes.get(output.request_id)
            if route is None:
                continue
            batches.setdefault(route.gateway_id, []).append(output_to_pb(output))
            if output.first_output_index == 0 and output.new_token_ids:
                route.span.add_event("first_token")
            if output.finished and not self.engine.scheduler.has_request(output.request_id):
                del self._routes[output.request_id]  # its last sample finished
                route.span.set_attribute("finish_reason", output.finish_reason.value)
                self._close(route)
        for gateway_id, events in batches.items():
            self.streams.publish(gateway_id, pb.TokenEventBatch(events=events))

    def _close(self, route: _Route) -> None:
        route.span.end()
        try:
            self._ack(route.entry_id)
        except Exception as exc:  # Redis down: the entry is re-read after a restart and deduplicated
            log.warning("could not acknowledge %r: %s", route.entry_id, exc)

    # ---- workers -------------------------------------------------------------------------
    def _poll_workers(self) -> None:
        now = time.monotonic()
        if now < self._next_worker_poll:
            return
        self._next_worker_poll = now + self.config.worker_poll_interval_s
        try:
            live = self._registry.live_workers()
        except Exception as exc:
            log.warning("cannot read worker registrations: %s", exc)
            return
        scheduler = self.engine.scheduler
        known = set(scheduler.worker_ids)
        self._dead_workers |= self._added_workers - known  # removed by the engine after a failed step
        self._added_workers &= known
        for worker_id in known - live.keys():
            log.info("worker %s is gone; its sequences are rescheduled", worker_id)
            scheduler.remove_worker(worker_id)
            self._executor.remove_worker(worker_id)
            self._added_workers.discard(worker_id)
        for worker_id, reg in live.items():
            if worker_id in known or worker_id in self._dead_workers:
                continue
            if reg.block_size != scheduler.config.block_size:
                log.error("worker %s uses block size %d, the scheduler %d: ignored", worker_id, reg.block_size,
                          scheduler.config.block_size)
                self._dead_workers.add(worker_id)
                continue
            log.info("worker %s at %s joined with %d blocks (%d CPU blocks)", worker_id, reg.address,
                     reg.num_blocks, reg.num_cpu_blocks)
            self._executor.add_worker(worker_id, reg.address)
            scheduler.add_worker(worker_id, reg.num_blocks, reg.num_cpu_blocks)
            self._added_workers.add(worker_id)
        self.stats = scheduler.stats()
