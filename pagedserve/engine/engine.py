"""The step loop: schedule, execute, apply.

``Engine`` is the same whether the workers are model runners in this process (``LocalExecutor``,
used by ``pagedserve.llm.LLM``, the tests and the benchmarks) or worker services reached over gRPC
(``services.scheduler.grpc_executor.GrpcExecutor``).
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

from pagedserve.engine.messages import BatchPlan, EngineRequest, RequestOutput, StepResult
from pagedserve.engine.scheduler import Scheduler


@dataclass(frozen=True)
class ExecutionResult:
    """What the workers answered for one iteration.

    Attributes:
        results: step results by worker id.
        failed_worker_ids: workers that did not answer; their sequences are rescheduled elsewhere.
    """

    results: Mapping[str, StepResult]
    failed_worker_ids: tuple[str, ...] = ()


class Executor(Protocol):
    """Runs one iteration's plans on the workers they are for."""

    def execute(self, plans: Mapping[str, BatchPlan]) -> ExecutionResult: ...


class PlanRunner(Protocol):
    """A worker's model runner as seen by the engine (``pagedserve.engine.model_runner.ModelRunner``)."""

    def execute(self, plan: BatchPlan) -> StepResult: ...


class LocalExecutor:
    """Executes plans on model runners in this process, one after another."""

    def __init__(self, runners: Mapping[str, PlanRunner]) -> None:
        self.runners = dict(runners)

    def execute(self, plans: Mapping[str, BatchPlan]) -> ExecutionResult:
        return ExecutionResult({wid: self.runners[wid].execute(plan) for wid, plan in plans.items()})


class ThreadedExecutor(LocalExecutor):
    """Executes each worker id's plan on that id's own thread, all ids at once, and waits for them:
    the virtual engines of a pipeline-parallel worker (``parallel/pipeline_runner.py``) then overlap
    in its stages. One id's plans still run one at a time, in order."""

    def __init__(self, runners: Mapping[str, PlanRunner]) -> None:
        super().__init__(runners)
        self._threads = {wid: ThreadPoolExecutor(1, thread_name_prefix=wid) for wid in self.runners}

    def execute(self, plans: Mapping[str, BatchPlan]) -> ExecutionResult:
        futures = {wid: self._threads[wid].submit(self.runners[wid].execute, plan) for wid, plan in plans.items()}
        return ExecutionResult({wid: future.result() for wid, future in futures.items()})


class Engine:
    """Drives a scheduler and an executor one iteration at a time. Not thread-safe."""

    def __init__(self, scheduler: Scheduler, executor: Executor) -> None:
        self.scheduler = scheduler
        self.executor = executor

    def add_request(self, request: EngineRequest) -> None:
        """Queues a request (see ``Scheduler.add_request``)."""
        self.scheduler.add_request(request)

    def abort_request(self, request_id: str, sample_index: int | None = None) -> list[RequestOutput]:
        """Stops a request (or one of its samples) and frees its blocks; returns the final outputs
        of the samples that were in flight (none if it had finished)."""
        return self.scheduler.abort_request(request_id, sample_index)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def has_work(self) -> bool:
        """Whether ``step`` has anything to do (requests, or worker state to drop)."""
        return self.scheduler.has_work()

    def step(self) -> list[RequestOutput]:
        """Runs one iteration on every worker and returns what it produced for each request."""
        scheduled = self.scheduler.schedule(self.scheduler.worker_ids)
        execution = self.executor.execute(scheduled.plans)
        lost = [out for worker_id in execution.failed_worker_ids for out in self.scheduler.remove_worker(worker_id)]
        return [*scheduled.outputs, *lost, *self.scheduler.update_from_output(execution.results)]
