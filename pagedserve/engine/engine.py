"""The step loop: schedule, execute, apply.

``Engine`` drives model runners in this process (``LocalExecutor``, used by
``pagedserve.llm.LLM``, the tests and the benchmarks); the scheduler service runs the same
``Scheduler`` over worker services reached by gRPC (``services/scheduler/loop.py``). Both keep up
to ``SchedulerConfig.max_plans_in_flight`` plans per worker: with 2, the next plan is made while
the model runs the current one (overlap scheduling).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

from pagedserve.engine.messages import BatchPlan, EngineRequest, SequenceId, StepResult
from pagedserve.engine.outputs import RequestOutput
from pagedserve.engine.scheduler import Scheduler


class PlanRunner(Protocol):
    """A worker's model runner as seen by the engine (``pagedserve.engine.model_runner.ModelRunner``)."""

    def execute(self, plan: BatchPlan) -> StepResult: ...


class LocalExecutor:
    """Runs plans on model runners in this process: each runner on a thread of its own, its plans
    one after another in the order they were submitted (so a plan finds the tokens that the one
    before it sampled), different runners at the same time."""

    def __init__(self, runners: Mapping[str, PlanRunner]) -> None:
        self.runners = dict(runners)
        self._threads = {wid: ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"model-{wid}")
                         for wid in self.runners}

    def submit(self, worker_id: str, plan: BatchPlan) -> Future[StepResult]:
        """Queues ``plan`` on its worker's thread. Raises KeyError for an unknown worker."""
        return self._threads[worker_id].submit(self.runners[worker_id].execute, plan)

    def shutdown(self) -> None:
        """Stops the threads once the plans queued have run."""
        for thread in self._threads.values():
            thread.shutdown()


@dataclass(frozen=True)
class _InFlight:
    worker_id: str
    result: Future[StepResult]


class Engine:
    """Drives a scheduler and a :class:`LocalExecutor`, one answered plan per :meth:`step`.

    Not thread-safe: one thread calls it.
    """

    def __init__(self, scheduler: Scheduler, executor: LocalExecutor) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self._in_flight: deque[_InFlight] = deque()  # plans sent, oldest first

    def add_request(self, request: EngineRequest) -> None:
        """Queues a request (see ``Scheduler.add_request``)."""
        self.scheduler.add_request(request)

    def abort_request(self, request_id: str) -> list[RequestOutput]:
        """Stops every sample of a request and frees its blocks; returns the final outputs of the
        samples that were in flight (none if it had finished)."""
        return self.scheduler.abort_request(request_id)

    def abort_sample(self, seq_id: SequenceId) -> list[RequestOutput]:
        """Stops one sample of a request (the others go on); as :meth:`abort_request`."""
        return self.scheduler.abort_sample(seq_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def has_work(self) -> bool:
        """Whether ``step`` has anything to do (requests, worker state to drop, answers to wait for)."""
        return self.scheduler.has_work() or bool(self._in_flight)

    def step(self) -> list[RequestOutput]:
        """Sends each worker plans until it has ``max_plans_in_flight`` in flight (the next made
        while the model runs the current one), then applies the oldest plan's answer.

        Returns:
            What the iteration produced for each request (tokens, finished or refused samples).

        Raises:
            Whatever a runner raised for the oldest plan (e.g. ``PlanMismatchError``).
        """
        outputs = self._send_plans()
        if self._in_flight:
            outputs += self._apply_oldest()
        while self._in_flight and not self.scheduler.has_unfinished_requests():
            outputs += self._apply_oldest()  # steps run ahead for sequences that have finished since
        return outputs

    def _apply_oldest(self) -> list[RequestOutput]:
        done = self._in_flight.popleft()
        return self.scheduler.update_from_output({done.worker_id: done.result.result()})

    def _send_plans(self) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        for _ in range(self.scheduler.config.max_plans_in_flight):
            counts = {w: 0 for w in self.scheduler.worker_ids}
            for sent in self._in_flight:
                counts[sent.worker_id] = counts.get(sent.worker_id, 0) + 1
            room = [w for w, n in counts.items() if n < self.scheduler.config.max_plans_in_flight]
            if not room or not self.scheduler.has_work():
                break
            scheduled = self.scheduler.schedule(room)
            outputs += scheduled.outputs
            for worker_id, plan in scheduled.plans.items():
                self._in_flight.append(_InFlight(worker_id, self.executor.submit(worker_id, plan)))
            if not scheduled.plans:
                break
        return outputs
