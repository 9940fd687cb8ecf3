"""The Worker gRPC service: a thin shell around the model runner, plus per-request trace spans."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import grpc
from opentelemetry import trace

from pagedserve.services.common import telemetry
from pagedserve.services.common.convert import plan_from_pb, step_result_to_pb
from pagedserve.engine.messages import BatchPlan, SequenceId, StepResult
from pagedserve.services.common.pb import engine_pb2 as pb
from pagedserve.services.common.pb import generate_pb2 as gen_pb
from pagedserve.services.common.pb_fields import union_from_pb
from pagedserve.engine.structured_output import GrammarError
from pagedserve.engine.structured_output import StructuredOutput
from pagedserve.services.common.pb import engine_pb2_grpc
from pagedserve.engine.engine import PlanRunner
from pagedserve.services.worker.metrics import WorkerMetrics


ORDER_WAIT_S = 10.0
"""Longest a plan waits for the plan before it to arrive (the scheduler's deadline, if shorter)."""


class RequestSpans:
    """One span per sequence on this worker: opened when it arrives in a plan, closed when dropped."""

    def __init__(self, tracer: trace.Tracer) -> None:
        self._tracer = tracer
        self._spans: dict[SequenceId, trace.Span] = {}

    def update(self, plan: BatchPlan) -> None:
        for seq_id in plan.finished_seq_ids:
            span = self._spans.pop(seq_id, None)
            if span is not None:
                span.end()
        for new in plan.new_requests:
            if new.seq_id in self._spans:
                continue
            span = self._tracer.start_span(
                "worker.request",
                context=telemetry.extract(new.trace_context),
                attributes={"request_id": new.request_id, "sample_index": new.seq_id.sample_index,
                            "num_tokens": len(new.token_ids)},
            )
            self._spans[new.seq_id] = span


class PlanOutOfOrder(ValueError):
    """A plan that must not run: its session is over or failed, or the plan before it never came."""


class PlanAbandoned(Exception):
    """A plan whose caller stopped waiting (its deadline passed, or it cancelled) before the plan
    started: the scheduler has counted the step failed and resets this worker, so running it would
    only delay the plans of the new session (a worker resumed after a stall finds a queue of them)."""


class PlanOrder:
    """Starts a session's plans in step order (1, 2, 3, ...), however their calls arrive.

    The scheduler may send a worker its next plan before the current one is answered (overlap
    scheduling); two calls can reach the handlers in either order, and a plan must run after the
    one before it, whose sampled tokens it continues from. A plan of a new session (step 1) starts
    that session; plans of older sessions, and those after a plan of their session failed, are
    refused.
    """

    def __init__(self) -> None:
        self._turn = threading.Condition()
        self._session = ""
        self._next_step = 1
        self._failed_session = ""

    def start_in_turn(self, plan: BatchPlan, timeout_s: float, start: Callable[[], Future],
                      admit: Callable[[], None] = lambda: None) -> Future:
        """Waits until ``plan`` is next, calls ``admit`` (which may refuse it), then ``start`` (which
        must queue the plan for the model thread) before letting the next plan through.

        Raises:
            PlanOutOfOrder: ``plan`` is not next within ``timeout_s`` seconds, or ``admit`` refused it.
        """
        with self._turn:
            if not self._turn.wait_for(lambda: self._is_next(plan), timeout=timeout_s):
                raise PlanOutOfOrder(f"the worker expects plan {self._next_step} of session {self._session[:8]}")
            admit()  # here, not only on arrival: a newer owner's plan may have started meanwhile
            self._session, self._next_step = plan.session_id, plan.step_id + 1
            self._turn.notify_all()
            return start()

    def check(self, plan: BatchPlan) -> None:
        """Raises :class:`PlanOutOfOrder` if a plan of ``plan``'s session failed before it."""
        if plan.session_id == self._failed_session:
            raise PlanOutOfOrder(f"an earlier plan of session {plan.session_id[:8]} failed")

    def failed(self, plan: BatchPlan) -> None:
        """Marks ``plan``'s session failed: the plans after it build on state it did not make."""
        self._failed_session = plan.session_id

    def _is_next(self, plan: BatchPlan) -> bool:
        if plan.session_id == self._session:
            return plan.step_id == self._next_step
        return plan.step_id == 1


class LeaseFence:
    """Refuses plans sent under a lease epoch older than the newest this worker has accepted.

    Each scheduler that takes this worker over gets a larger epoch (``pagedserve.services.scheduler.leases``)
    and sends it in every plan, so once the new owner's first plan has arrived, a scheduler that
    lost its lease (but does not know it yet) cannot drive the worker any more.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.newest_epoch = 0

    def admit(self, lease_epoch: int) -> None:
        """Raises :class:`PlanOutOfOrder` if ``lease_epoch`` is older than the newest accepted."""
        with self._lock:
            if lease_epoch < self.newest_epoch:
                raise PlanOutOfOrder(f"lease epoch {lease_epoch} is older than {self.newest_epoch}: another "
                                     "scheduler owns this worker now")
            self.newest_epoch = lease_epoch


class WorkerServicer(engine_pb2_grpc.WorkerServicer):
    """Executes the scheduler's plans one at a time in step order, always on the same thread.

    One model thread matters on CPU: torch's OpenMP runtime keeps a thread team per calling
    thread, and teams left by gRPC's rotating handler threads compete for the cores.
    """

    def __init__(self, runner: PlanRunner, tracer: trace.Tracer, metrics: WorkerMetrics | None = None) -> None:
        self._runner = runner
        self._metrics = metrics
        self._spans = RequestSpans(tracer)
        self._model_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")
        self._order = PlanOrder()
        self._fence = LeaseFence()

    def Execute(self, request: pb.BatchPlan, context: grpc.ServicerContext) -> pb.StepResult:
        """Runs one plan after the plans before it; a plan that contradicts the worker's state,
        comes out of order, or is fenced off (an older lease epoch), is FAILED_PRECONDITION."""
        try:
            self._fence.admit(request.lease_epoch)
        except PlanOutOfOrder as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        plan = plan_from_pb(request)
        remaining = context.time_remaining()
        wait_s = ORDER_WAIT_S if remaining is None else min(remaining, ORDER_WAIT_S)
        try:
            result = self._order.start_in_turn(
                plan, wait_s, lambda: self._model_thread.submit(self._execute, plan, context.is_active),
                lambda: self._fence.admit(request.lease_epoch)).result()
        except (ValueError, KeyError) as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"plan {plan.step_id} does not apply: {exc}")
        except PlanAbandoned as exc:
            context.abort(grpc.StatusCode.CANCELLED, str(exc))
        return step_result_to_pb(result)

    def PrepareGrammar(self, request: gen_pb.StructuredOutput, context: grpc.ServicerContext) -> pb.GrammarBuilt:
        """Builds a structured output's grammar on the runner's compile thread, answering once it
        is built; INVALID_ARGUMENT if it does not build, DEADLINE_EXCEEDED past the caller's deadline."""
        structure = union_from_pb(request, StructuredOutput)
        if structure is None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "PrepareGrammar needs one structured output kind set")
        try:
            self._runner.prepare(structure).result(timeout=context.time_remaining())
        except GrammarError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except TimeoutError:
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the grammar is still building")
        return pb.GrammarBuilt()

    def _execute(self, plan: BatchPlan, caller_waits: Callable[[], bool]) -> StepResult:
        """Runs on the model thread, one plan at a time; a plan whose caller stopped waiting is
        skipped (:class:`PlanAbandoned`) and fails its session."""
        self._order.check(plan)
        if not caller_waits():
            self._order.failed(plan)
            raise PlanAbandoned(f"plan {plan.step_id} of session {plan.session_id[:8]}: the scheduler stopped "
                                "waiting for it")
        self._spans.update(plan)
        start = time.perf_counter()
        try:
            result = self._runner.execute(plan)
        except Exception:
            self._order.failed(plan)
            raise
        if self._metrics is not None:
            self._metrics.step_done(time.perf_counter() - start)
        return result
