"""The one step driver: schedule, send plans to an executor, apply the answers.

``Engine`` keeps up to ``SchedulerConfig.max_plans_in_flight`` plans unanswered per worker session
(with 2, the next plan is made while the model runs the current one: overlap scheduling) and
applies each answer when it comes. It drives any :class:`Executor`: ``LocalExecutor`` runs model
runners in this process (``pagedserve.llm.LLM``, the tests, the benchmarks), and the scheduler
service's ``GrpcExecutor`` sends plans to worker services. The offline path calls :meth:`Engine.step`,
which waits for the oldest answer; the service calls :meth:`Engine.send_plans`, and as each answer
arrives :meth:`Engine.arrived` then :meth:`Engine.apply` (``pagedserve/services/scheduler/loop.py``).

Answers of one worker session are applied in the order their plans were sent: a plan's tokens in
flight resolve oldest first, and the next plan continues from the tokens the one before sampled.
Two answers can reach the service in the other order (the worker's gRPC handler threads race to
send them), so :meth:`Engine.arrived` holds an answer until those before it are applied.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import Counter, deque
from collections.abc import Collection, Mapping, Sequence as Seq
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Protocol

from pagedserve.engine.structured_output import GrammarError
from pagedserve.engine.messages import BatchPlan, EngineRequest, ResumedSample, SequenceId, StepResult
from pagedserve.engine.outputs import RequestOutput
from pagedserve.engine.scheduler import Scheduler
from pagedserve.engine.limits import grammar_failure
from pagedserve.engine.structured_output import StructuredOutput

log = logging.getLogger("pagedserve.scheduler")

GRAMMAR_WAIT_S = 0.1
"""Longest :meth:`Engine.step` waits for a grammar when only held requests are left (seconds)."""


class StepFailed(Exception):
    """A worker did not answer a plan (it failed, timed out or went away); the message says how."""


class Executor(Protocol):
    """Runs plans on workers.

    ``submit`` returns at once; the future holds the worker's :class:`StepResult`, or raises why it
    has none (``StepFailed`` from a remote worker; a local runner's own exception). Plans sent to one
    worker run in the order they were submitted (a plan finds the tokens the one before it sampled).
    """

    def submit(self, worker_id: str, plan: BatchPlan) -> Future[StepResult]: ...

    def prepare(self, structure: StructuredOutput) -> Future[None]:
        """Has every worker build ``structure``'s grammar; the future is done when all have (it
        raises ``GrammarError`` if the grammar does not build)."""
        ...


class PlanRunner(Protocol):
    """A worker's model runner as seen by the engine (``pagedserve.engine.model_runner.ModelRunner``)."""

    def execute(self, plan: BatchPlan) -> StepResult: ...

    def prepare(self, structure: StructuredOutput) -> Future[None]:
        """Builds ``structure``'s grammar off the model thread (``GrammarCompiler.prepare``)."""
        ...


def gather(futures: Collection[Future[None]]) -> Future[None]:
    """A future done when all of ``futures`` are; it raises the first of their exceptions, if any."""
    combined: Future[None] = Future()
    pending = set(futures)
    lock = threading.Lock()

    def one_done(future: Future) -> None:
        with lock:
            pending.discard(future)
            if pending:
                return
        error = next((e for e in (f.exception() for f in futures) if e is not None), None)
        combined.set_exception(error) if error is not None else combined.set_result(None)

    if not futures:
        combined.set_result(None)
    for future in futures:
        future.add_done_callback(one_done)
    return combined


class LocalExecutor:
    """Runs plans on model runners in this process: each runner on a thread of its own, its plans
    one after another in the order they were submitted, different runners at the same time."""

    def __init__(self, runners: Mapping[str, PlanRunner]) -> None:
        self.runners = dict(runners)
        self._threads = {wid: ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"model-{wid}")
                         for wid in self.runners}

    def submit(self, worker_id: str, plan: BatchPlan) -> Future[StepResult]:
        """Queues ``plan`` on its worker's thread. Raises KeyError for an unknown worker."""
        return self._threads[worker_id].submit(self.runners[worker_id].execute, plan)

    def prepare(self, structure: StructuredOutput) -> Future[None]:
        """See :meth:`Executor.prepare`."""
        return gather([runner.prepare(structure) for runner in self.runners.values()])

    def shutdown(self) -> None:
        """Stops the threads once the plans queued have run."""
        for thread in self._threads.values():
            thread.shutdown()


@dataclass(frozen=True, eq=False)
class SentPlan:
    """A plan on its way to a worker.

    Attributes:
        worker_id: the worker it went to.
        plan: the plan (its ``session_id`` tells an answer from a reset worker's older session).
        answer: the worker's answer, when it comes.
        num_ahead: plans of the same session sent before it and not answered yet.
    """

    worker_id: str
    plan: BatchPlan
    answer: Future[StepResult]
    num_ahead: int


@dataclass(frozen=True)
class Dispatch:
    """What one :meth:`Engine.send_plans` did: outputs made while scheduling (refused or aborted
    samples) and the plans it sent."""

    outputs: list[RequestOutput]
    sent: list[SentPlan]


class Engine:
    """Drives a scheduler over an :class:`Executor`. Not thread-safe: one thread calls it."""

    def __init__(self, scheduler: Scheduler, executor: Executor) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self._in_flight: deque[SentPlan] = deque()  # plans sent and not yet applied, oldest first
        self._arrived: set[SentPlan] = set()  # answered, waiting for an older plan of their session
        self._grammars: dict[str, Future[None]] = {}  # request id -> its grammar's build on the workers

    def add_request(self, request: EngineRequest) -> None:
        """Queues a request (see ``Scheduler.add_request``). One with a structured output is held
        until every worker has built its grammar (``Executor.prepare``), so that no step's model
        thread stops to compile it; one whose grammar does not build ends with INVALID_ARGUMENT."""
        self.scheduler.add_request(request)
        self._prepare(request)

    def resume_request(self, request: EngineRequest, resumed: Seq[ResumedSample]) -> None:
        """Takes over a request another scheduler ran (see ``Scheduler.resume_request``); held
        for its grammar as in :meth:`add_request`."""
        self.scheduler.resume_request(request, resumed)
        self._prepare(request)

    def _prepare(self, request: EngineRequest) -> None:
        structure = request.sampling.structured_output
        if structure is not None:
            self.scheduler.hold_request(request.request_id)
            self._grammars[request.request_id] = self.executor.prepare(structure)

    def _release_built(self) -> list[RequestOutput]:
        """Queues the held requests whose grammar is built; ends those whose grammar failed."""
        outputs: list[RequestOutput] = []
        for request_id in [r for r, f in self._grammars.items() if f.done()]:
            error = self._grammars.pop(request_id).exception()
            if isinstance(error, GrammarError):
                outputs += self.scheduler.abort_request(request_id, grammar_failure(f"structured_output: {error}"))
                continue
            if error is not None:  # a worker that did not answer builds it when the request arrives
                log.warning("request %s: a worker did not build its grammar in advance (%s)", request_id, error)
            self.scheduler.release_request(request_id)
        return outputs

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

    def send_plans(self) -> Dispatch:
        """Sends each worker plans until its session has ``max_plans_in_flight`` unanswered."""
        most = self.scheduler.config.max_plans_in_flight
        outputs = self._release_built()
        sent: list[SentPlan] = []
        for _ in range(most):
            unanswered = Counter(s.plan.session_id for s in self._in_flight)
            room = [w for w in self.scheduler.worker_ids if unanswered[self.scheduler.session_id(w)] < most]
            if not room or not self.scheduler.has_work():
                break
            scheduled = self.scheduler.schedule(room)
            outputs += scheduled.outputs
            for worker_id, plan in scheduled.plans.items():
                sent.append(SentPlan(worker_id, plan, self.executor.submit(worker_id, plan),
                                     unanswered[plan.session_id]))
                self._in_flight.append(sent[-1])
            if not scheduled.plans:
                break
        return Dispatch(outputs, sent)

    def is_current(self, sent: SentPlan) -> bool:
        """Whether ``sent`` belongs to its worker's current session (not to one reset since, when
        the worker failed or restarted: such an answer is dropped)."""
        return sent.plan.session_id == self.scheduler.session_id(sent.worker_id)

    def arrived(self, sent: SentPlan) -> list[SentPlan]:
        """Notes that ``sent``'s answer came; returns the plans to :meth:`apply` now, in order:
        ``sent`` and the answers held after it, or none while a plan sent before it to the same
        worker session is unanswered (``sent`` is held until that one arrives). The answers of a
        session reset since are returned at once, in any order (:meth:`apply` drops them)."""
        self._arrived.add(sent)
        session = [s for s in self._in_flight if s.plan.session_id == sent.plan.session_id]
        if self.is_current(sent):
            due = list(itertools.takewhile(lambda s: s in self._arrived, session))
        else:
            due = [s for s in session if s in self._arrived]
        self._arrived.difference_update(due)
        return due

    def apply(self, sent: SentPlan) -> list[RequestOutput]:
        """Applies a sent plan's answer (waiting for it if it has not come); an answer from a
        worker session that was reset since (the worker failed or restarted) is dropped.

        Raises:
            ValueError: a plan sent before ``sent`` to the same (current) worker session is not
                applied yet (see :meth:`arrived`); nothing changes then.
            Whatever the answer holds instead of a result: ``StepFailed``, or a local runner's
            exception (e.g. ``PlanMismatchError``). The plan counts as answered either way.
        """
        current = self.is_current(sent)
        older = next((s for s in self._in_flight if s.plan.session_id == sent.plan.session_id), sent)
        if current and older is not sent:
            raise ValueError(f"step {sent.plan.step_id} of worker {sent.worker_id} applied before step "
                             f"{older.plan.step_id}: apply a session's answers in the order of its plans")
        self._in_flight.remove(sent)
        if not current:
            return []
        return self.scheduler.update_from_output({sent.worker_id: sent.answer.result()})

    def step(self) -> list[RequestOutput]:
        """One iteration: sends plans, then applies the oldest plan's answer (waiting for it).

        Returns:
            What the iteration produced for each request (tokens, finished or refused samples).

        Raises:
            Whatever the oldest plan's answer raised (see :meth:`apply`).
        """
        outputs = self.send_plans().outputs
        if self._in_flight:
            outputs += self.apply(self._in_flight[0])
        elif self._grammars:  # only held requests: wait a little for a grammar instead of spinning
            wait(list(self._grammars.values()), timeout=GRAMMAR_WAIT_S, return_when=FIRST_COMPLETED)
        while self._in_flight and not self.scheduler.has_unfinished_requests():
            outputs += self.apply(self._in_flight[0])  # steps run ahead for sequences that have finished since
        return outputs
