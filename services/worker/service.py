"""The Worker gRPC service: a thin shell around the model runner, plus per-request trace spans."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
from opentelemetry import trace

from services.common import telemetry
from services.common.convert import plan_from_pb, step_result_to_pb
from pagedserve.engine.messages import BatchPlan, SequenceId, StepResult
from services.common.pb import engine_pb2 as pb
from services.common.pb import engine_pb2_grpc
from pagedserve.engine.engine import PlanRunner
from services.worker.metrics import WorkerMetrics


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


class WorkerServicer(engine_pb2_grpc.WorkerServicer):
    """Executes the scheduler's plans one at a time, always on the same thread.

    One model thread matters on CPU: torch's OpenMP runtime keeps a thread team per calling
    thread, and teams left by gRPC's rotating handler threads compete for the cores.
    """

    def __init__(self, runner: PlanRunner, tracer: trace.Tracer, metrics: WorkerMetrics | None = None) -> None:
        self._runner = runner
        self._metrics = metrics
        self._spans = RequestSpans(tracer)
        self._model_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")

    def Execute(self, request: pb.BatchPlan, context: grpc.ServicerContext) -> pb.StepResult:
        """Runs one plan; a plan that contradicts the worker's state is FAILED_PRECONDITION."""
        plan = plan_from_pb(request)
        try:
            result = self._model_thread.submit(self._execute, plan).result()
        except (ValueError, KeyError) as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"plan {plan.step_id} does not apply: {exc}")
        return step_result_to_pb(result)

    def _execute(self, plan: BatchPlan) -> StepResult:
        self._spans.update(plan)
        start = time.perf_counter()
        result = self._runner.execute(plan)
        if self._metrics is not None:
            self._metrics.step_done(time.perf_counter() - start)
        return result
