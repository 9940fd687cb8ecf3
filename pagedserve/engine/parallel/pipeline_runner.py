"""Rank 0 of a pipeline-parallel worker and its virtual engines (vLLM's ``virtual_engine``).

A worker of P stages exposes V virtual engines (V = P by default): each has its own
sequences and its own KV blocks (every rank's budget split V ways), and is a worker id of its own to
the scheduler. Plans of different virtual engines are independent, so the stages overlap them:
stage 0 runs engine 0's plan and sends its activations on, then runs engine 1's plan while stage 1
runs engine 0's (the pipeline of GPipe, Huang et al., 2019, with one plan per "micro-batch").

How a plan reaches every rank: ``execute`` on virtual engine ``v`` takes rank 0's dispatch lock,
numbers the plan, pipes ``(number, v, plan, tokens v sampled in its previous step)`` to every
helper rank (each applies the tokens, then the plan to its runner of ``v``), runs stage 0 itself
and releases the lock; every rank thus runs the plans in the same order. The last stage's
tensor-parallel rank 0 samples and pipes ``(number, StepResult)`` back; ``execute`` waits for it.
No collective spans the whole grid during a step (activations go stage to stage with gloo
``send``/``recv``; a send returns once the next stage has posted its receive), so stage 0 may start
the next plan before the last stage ends the previous one.

Bubble: with one virtual engine the stages run one after another, ``(P-1)/P`` of each stage's time
idle (Narayanan et al., 2021, §2.2, one micro-batch); with V engines given plans together, up to V
plans fill the pipeline. ``stage_busy_seconds`` measures each rank's busy time to report it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from multiprocessing.connection import Connection

import torch

from pagedserve.engine.messages import BatchPlan, SampledToken, StepResult
from pagedserve.engine.model_runner import PlanMismatchError
from pagedserve.engine.parallel.group import COLLECTIVE_TIMEOUT_S, CollectiveError, GroupSpec, TensorParallelGroup
from pagedserve.engine.parallel.pipeline import StageRunner
from pagedserve.engine.parallel.rank import RankConfig, build_stage_runners
from pagedserve.engine.parallel.rank_link import LOCAL, RankPlacement
from pagedserve.engine.parallel.spawn import STOP, launch_ranks, stop_helpers
from pagedserve.engine.structured_output import StructuredOutput

_STATS = "stats"
_RESULT, _BUSY = "result", "busy"


class BusyClock:
    """A rank's busy seconds: time in its runners' ``execute`` minus time blocked in send/recv."""

    def __init__(self, runners: Sequence[StageRunner]) -> None:
        self.forward = runners[0].forward  # the StageForward the runners share
        self.execute_s = 0.0

    def run(self, runner: StageRunner, plan: BatchPlan) -> StepResult:
        start = time.perf_counter()
        try:
            return runner.execute(plan)
        finally:
            self.execute_s += time.perf_counter() - start

    @property
    def busy_s(self) -> float:
        return self.execute_s - self.forward.comm_s


def pipeline_helper_main(config: RankConfig, spec: GroupSpec, rank: int, conn: Connection) -> None:
    """Entry point of helper rank ``rank``: join the grid, build its runner per virtual engine, then
    run the plans rank 0 pipes, in order, until it says stop (or its pipe closes). The sampling rank
    pipes each plan's StepResult (or the error) back."""
    if config.num_threads > 0:
        torch.set_num_threads(config.num_threads)
    conn.send("started")
    group = TensorParallelGroup(spec, rank)
    try:
        runners = build_stage_runners(config, group)
        leader = rank == (config.pipeline_parallel_size - 1) * (spec.world_size // config.pipeline_parallel_size)
        clock = BusyClock(runners)
        conn.send("ready")
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):  # rank 0 is gone
                return
            if message == STOP:
                return
            if message == _STATS:
                conn.send((_BUSY, clock.busy_s))
                continue
            number, engine, plan, sampled = message
            runners[engine].append_sampled(sampled)
            try:
                result = clock.run(runners[engine], plan)
            except Exception as exc:  # a mismatch (rank 0 raises it too), a dead peer, a sampler error
                result = exc
            if leader:
                conn.send((_RESULT, number, result))
            if isinstance(result, Exception) and not isinstance(result, PlanMismatchError):
                return  # the ranks' states no longer agree: this worker is done
    finally:
        group.close()


class PipelineParallelRunner:
    """Rank 0 (stage 0, tensor-parallel rank 0) of a ``T x P`` worker with V virtual engines.

    Args:
        runners: rank 0's runner of each virtual engine.
        group: the grid's group (rank 0's).
        helpers: ``(process, pipe)`` of ranks 1..T*P-1.
        leader: the sampling rank (tensor-parallel rank 0 of the last stage), ``(P-1)*T``.
        result_timeout_s: how long ``execute`` waits for a plan's result from the last stage
            (the later stages' compute, and plans queued before it, included) before failing the worker.
    """

    def __init__(self, runners: list[StageRunner], group: TensorParallelGroup,
                 helpers: list, leader: int, result_timeout_s: float = 60.0) -> None:
        self.runners = runners
        self.group = group
        self.helpers = helpers
        self.leader_pipe = helpers[leader - 1][1]
        self.result_timeout_s = result_timeout_s
        self.broken: str | None = None
        self.on_failure: Callable[[], None] | None = None
        self.clock = BusyClock(runners)
        self._dispatch = threading.Lock()
        self._pending: dict[int, Future] = {}
        self._busy_replies: list[float] = []
        self._sampled: list[Sequence[SampledToken]] = [() for _ in runners]
        self._count = 0
        self._receiver = threading.Thread(target=self._receive, name="pipeline-results", daemon=True)
        self._receiver.start()

    @property
    def num_virtual_engines(self) -> int:
        return len(self.runners)

    def virtual_engines(self) -> list[VirtualEngine]:
        """One :class:`VirtualEngine` per engine: what the scheduler sees as workers."""
        return [VirtualEngine(self, index) for index in range(len(self.runners))]

    def execute_on(self, engine: int, plan: BatchPlan) -> StepResult:
        """Runs ``plan`` on virtual engine ``engine`` (thread-safe; one engine's plans one at a time).

        Raises:
            CollectiveError: a rank died or stopped answering (now or earlier): the worker is broken.
            PlanMismatchError: as ``ModelRunner.execute`` (every rank refuses the plan alike).
        """
        with self._dispatch:
            self._check()
            number, future = self._count, Future()
            self._count += 1
            self._pending[number] = future
            sampled, self._sampled[engine] = self._sampled[engine], ()
            try:
                for _, conn in self.helpers:
                    conn.send((number, engine, plan, sampled))
                self.runners[engine].append_sampled(sampled)
                self.clock.run(self.runners[engine], plan)
            except PlanMismatchError:
                raise
            except Exception as exc:
                raise self._fail(f"rank 0: {exc}") from exc
        result = self._wait(future)
        self._sampled[engine] = result.sampled
        return result

    def _wait(self, future: Future) -> StepResult:
        """The last stage's answer; fails the worker on a dead helper, an error or the timeout."""
        deadline = time.monotonic() + self.result_timeout_s
        while not future.done():
            dead = [p.name for p, _ in self.helpers if not p.is_alive()]
            if dead or time.monotonic() > deadline:
                reason = f"helper ranks {dead} exited" if dead else f"no result within {self.result_timeout_s} s"
                raise self._fail(reason)
            try:
                future.exception(timeout=0.2)
            except TimeoutError:
                continue
        result = future.result()
        if isinstance(result, PlanMismatchError):
            raise result
        if isinstance(result, Exception):
            raise self._fail(f"the last stage failed: {result}")
        return result

    def _receive(self) -> None:
        """Thread: routes the sampling rank's messages (results to their futures, busy times)."""
        try:
            while True:
                message = self.leader_pipe.recv()
                if message[0] == _BUSY:
                    self._busy_replies.append(message[1])
                elif (future := self._pending.pop(message[1], None)) is not None:  # None: failed already
                    future.set_result(message[2])
        except (EOFError, OSError) as exc:
            if self.helpers:  # not closing
                self._fail(f"the sampling rank's pipe closed: {exc!r}")

    def _check(self) -> None:
        if self.broken:
            raise CollectiveError(f"the pipeline-parallel worker failed earlier: {self.broken}")

    def _fail(self, reason: str) -> CollectiveError:
        """Marks the worker broken, fails every waiting plan; returns the error to raise."""
        if self.broken is None:
            self.broken = reason
            if self.on_failure is not None:
                self.on_failure()
        error = CollectiveError(reason)
        for number in list(self._pending):
            future = self._pending.pop(number, None)
            if future is not None and not future.done():
                future.set_exception(error)
        return error

    def stage_busy_seconds(self) -> list[float]:
        """Busy seconds of every rank so far, rank order (each helper answers after its queued plans)."""
        with self._dispatch:
            self._check()
            for _, conn in self.helpers:
                conn.send(_STATS)
            busy = [self.clock.busy_s]
            for _, conn in self.helpers:
                if conn is not self.leader_pipe:
                    busy.append(conn.recv()[1])
                else:
                    while not self._busy_replies:
                        time.sleep(0.01)
                    busy.append(self._busy_replies.pop())
            return busy

    def close(self) -> None:
        """Stops the helpers and leaves the group; idempotent."""
        helpers, self.helpers = self.helpers, []
        stop_helpers(helpers)
        self.group.close()


class VirtualEngine:
    """One virtual engine of a :class:`PipelineParallelRunner`, with the ``ModelRunner`` interface
    the engine uses (a worker id of its own to the scheduler)."""

    def __init__(self, pipeline: PipelineParallelRunner, index: int) -> None:
        self.pipeline = pipeline
        self.index = index

    @property
    def num_blocks(self) -> int:
        return self.pipeline.runners[self.index].num_blocks

    @property
    def num_cpu_blocks(self) -> int:
        return self.pipeline.runners[self.index].num_cpu_blocks

    @property
    def block_size(self) -> int:
        return self.pipeline.runners[self.index].block_size

    @property
    def broken(self) -> str | None:
        return self.pipeline.broken

    @property
    def on_failure(self) -> Callable[[], None] | None:
        return self.pipeline.on_failure

    @on_failure.setter
    def on_failure(self, callback: Callable[[], None] | None) -> None:
        self.pipeline.on_failure = callback  # e.g. a worker service stopping itself

    def prepare(self, structure: StructuredOutput) -> Future[None]:
        """The last stage's sampling rank builds the grammar, when it is in this process; a rank
        elsewhere builds it when the request's first plan reaches it."""
        return self.pipeline.runners[self.index].prepare(structure)

    def execute(self, plan: BatchPlan) -> StepResult:
        """See :meth:`PipelineParallelRunner.execute_on`."""
        return self.pipeline.execute_on(self.index, plan)

    def close(self) -> None:
        self.pipeline.close()


def start_pipeline_parallel_runner(config: RankConfig, tensor_parallel_size: int, timeout_s: float = COLLECTIVE_TIMEOUT_S,
                                   placement: RankPlacement = LOCAL) -> PipelineParallelRunner:
    """Spawns the ``T x P`` grid's helper ranks (or waits for them: ``placement``), joins them as
    rank 0 and loads every stage.

    Raises:
        ShardingError, PipelineError: the model cannot be split (checked before spawning).
        ValueError: an invalid placement. CollectiveError: a helper failed to start or join.
    """
    group, helpers, runners = launch_ranks(config, tensor_parallel_size, timeout_s, pipeline_helper_main,
                                           build_stage_runners, placement)
    leader = (config.pipeline_parallel_size - 1) * tensor_parallel_size
    return PipelineParallelRunner(runners, group, helpers, leader)
