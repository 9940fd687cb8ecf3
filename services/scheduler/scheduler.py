"""Iteration-level scheduling (Orca, Yu et al., OSDI 2022, §3) over paged KV blocks (vLLM).

Each iteration, per worker: running sequences get their next tokens first (one decode token, or
the next prefill chunk), preempting the newest running sequence when blocks run out; then waiting
sequences are admitted first-come first-served onto the worker with the most free blocks, under
``max_num_seqs`` and the ``max_num_batched_tokens`` budget. Preemption is by recompute: the victim
frees its blocks and returns to the front of the waiting queue to be prefilled again (prompt and
the tokens it had generated).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from services.common.messages import (
    BatchPlan,
    CachedRequestData,
    EngineRequest,
    FinishReason,
    NewRequestData,
    RequestError,
    RequestOutput,
    StepResult,
)
from services.scheduler.block_manager import BlockManager
from services.scheduler.config import SchedulerConfig, SchedulerStats, WorkerStats
from services.scheduler.sequence import Sequence, SequenceStatus

GRPC_RESOURCE_EXHAUSTED = 8  # grpc.StatusCode.RESOURCE_EXHAUSTED


class WorkerState:
    """The scheduler's view of one worker: its block manager and the sequences running on it.

    ``running`` keeps admission order, so its last entry is the newest: the preemption victim.
    ``dropped_ids`` are requests whose worker-side state must be dropped with the next plan.
    """

    def __init__(self, worker_id: str, num_blocks: int, block_size: int) -> None:
        self.worker_id = worker_id
        self.blocks = BlockManager(num_blocks, block_size)
        self.running: OrderedDict[str, Sequence] = OrderedDict()
        self.dropped_ids: list[str] = []


@dataclass
class _PlanDraft:
    """One worker's plan while the iteration is being scheduled."""

    token_budget: int
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    preempted: bool = False


@dataclass(frozen=True)
class SchedulerOutput:
    """The plans of one iteration, keyed by worker id (workers with nothing to do are left out)."""

    step_id: int
    plans: Mapping[str, BatchPlan]


class Scheduler:
    """Owns the sequences, the waiting queue and one block manager per worker.

    Not thread-safe: one thread calls it (the engine loop).
    """

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self._workers: dict[str, WorkerState] = {}
        self._sequences: dict[str, Sequence] = {}
        self._waiting: OrderedDict[str, Sequence] = OrderedDict()
        self._outputs: list[RequestOutput] = []  # produced outside update_from_output
        self._step_id = 0
        self._num_preemptions = 0

    # ---- workers -------------------------------------------------------------------------
    def add_worker(self, worker_id: str, num_blocks: int) -> None:
        """Registers a worker with ``num_blocks`` KV blocks. Raises ValueError if already known."""
        if worker_id in self._workers:
            raise ValueError(f"worker {worker_id!r} is already registered")
        self._workers[worker_id] = WorkerState(worker_id, num_blocks, self.config.block_size)

    def remove_worker(self, worker_id: str) -> None:
        """Forgets a worker (gone or failed); its sequences go back to the front of the queue."""
        worker = self._workers.pop(worker_id, None)
        if worker is None:
            return
        for seq in reversed(worker.running.values()):
            self._requeue_front(seq)

    @property
    def worker_ids(self) -> list[str]:
        return list(self._workers)

    def requests_on(self, worker_id: str) -> Iterable[str]:
        """Ids of the sequences running on a worker."""
        return list(self._workers[worker_id].running)

    def block_manager(self, worker_id: str) -> BlockManager:
        return self._workers[worker_id].blocks

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, request: EngineRequest) -> None:
        """Queues a request at the back of the waiting queue.

        Raises:
            ValueError: a request with this id is already in flight.
        """
        if request.request_id in self._sequences:
            raise ValueError(f"request {request.request_id!r} is already in flight")
        seq = Sequence(request)
        self._sequences[request.request_id] = seq
        self._waiting[request.request_id] = seq

    def abort_request(self, request_id: str) -> bool:
        """Finishes a request now and frees its blocks. Returns False if it was not in flight."""
        seq = self._sequences.get(request_id)
        if seq is None:
            return False
        self._finish(seq, FinishReason.ABORT)
        return True

    def has_unfinished_requests(self) -> bool:
        """Requests in flight, or outputs not yet returned by ``update_from_output``."""
        return bool(self._sequences) or bool(self._outputs)

    def has_work(self) -> bool:
        """Unfinished requests, or workers still to be told to drop finished requests' state."""
        return self.has_unfinished_requests() or any(w.dropped_ids for w in self._workers.values())

    def sequence(self, request_id: str) -> Sequence:
        """The in-flight sequence with this id. Raises KeyError if none."""
        return self._sequences[request_id]

    # ---- one iteration -------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Decides who runs in this iteration, with which blocks; one plan per busy worker."""
        self._step_id += 1
        drafts = {wid: _PlanDraft(self.config.max_num_batched_tokens) for wid in self._workers}
        for worker in self._workers.values():
            self._schedule_running(worker, drafts[worker.worker_id])
        self._schedule_waiting(drafts)
        plans = {}
        for worker in self._workers.values():
            draft = drafts[worker.worker_id]
            plan = BatchPlan(
                step_id=self._step_id,
                new_requests=tuple(draft.new_requests),
                cached_requests=tuple(draft.cached_requests),
                finished_request_ids=tuple(worker.dropped_ids),
            )
            worker.dropped_ids.clear()
            if not plan.is_empty:
                plans[worker.worker_id] = plan
        return SchedulerOutput(self._step_id, plans)

    def update_from_output(self, results: Mapping[str, StepResult]) -> list[RequestOutput]:
        """Applies sampled tokens; finished sequences free their blocks now.

        Returns:
            One output per request that got a token or finished, plus earlier rejections.
        """
        outputs, self._outputs = self._outputs, []
        for result in results.values():
            for sampled in result.sampled:
                seq = self._sequences.get(sampled.request_id)
                if seq is None or seq.status is not SequenceStatus.RUNNING:
                    continue  # aborted while the step ran
                index = seq.num_output_tokens
                reason = seq.append_token(sampled.token_id)
                if reason is not None:
                    self._finish(seq, reason)
                outputs.append(RequestOutput(seq.request_id, index, (sampled.token_id,), reason))
        return outputs

    def stats(self) -> SchedulerStats:
        workers = tuple(
            WorkerStats(w.worker_id, w.blocks.num_blocks, w.blocks.num_free_blocks, len(w.running))
            for w in self._workers.values()
        )
        return SchedulerStats(
            num_waiting=len(self._waiting),
            num_running=sum(w.num_running for w in workers),
            num_preemptions=self._num_preemptions,
            num_steps=self._step_id,
            workers=workers,
        )

    # ---- policy pieces -------------------------------------------------------------------
    def _schedule_running(self, worker: WorkerState, draft: _PlanDraft) -> None:
        """Gives each running sequence its next tokens, oldest first, preempting when needed."""
        blocks = worker.blocks
        for seq in list(worker.running.values()):
            if seq.worker_id != worker.worker_id or draft.token_budget == 0:
                continue  # preempted earlier in this loop, or no budget left this iteration
            num_new = min(seq.num_uncomputed_tokens, draft.token_budget)
            num_blocks = blocks.num_new_blocks(seq.request_id, seq.num_computed_tokens + num_new)
            if num_blocks and not self._make_room(worker, seq, num_blocks, draft):
                continue
            new_block_ids = blocks.allocate_blocks(seq.request_id, num_blocks) if num_blocks else ()
            draft.cached_requests.append(
                CachedRequestData(seq.request_id, new_block_ids, seq.num_computed_tokens, num_new)
            )
            self._advance(seq, num_new, draft)

    def _make_room(self, worker: WorkerState, seq: Sequence, num_blocks: int, draft: _PlanDraft) -> bool:
        """Preempts the newest running sequences until ``num_blocks`` blocks are free for ``seq``.

        Returns False when ``seq`` itself had to be preempted.
        """
        while worker.blocks.num_free_blocks < num_blocks:
            victim = next(reversed(worker.running.values()))
            self._preempt(victim)
            draft.preempted = True  # no admissions on this worker in this iteration
            if victim is seq:
                return False
        return True

    def _schedule_waiting(self, drafts: dict[str, _PlanDraft]) -> None:
        """Admits waiting sequences in arrival order until one does not fit."""
        while self._waiting:
            seq = next(iter(self._waiting.values()))
            if not self._fits_any_worker(seq):
                continue  # rejected and removed from the queue
            worker = self._pick_worker(drafts)
            if worker is None:
                return
            draft = drafts[worker.worker_id]
            num_new = min(seq.num_uncomputed_tokens, draft.token_budget)
            if not worker.blocks.can_allocate(seq.request_id, num_new):
                return
            worker.blocks.allocate_slots(seq.request_id, num_new)
            del self._waiting[seq.request_id]
            seq.status, seq.worker_id = SequenceStatus.RUNNING, worker.worker_id
            worker.running[seq.request_id] = seq
            draft.new_requests.append(
                NewRequestData(
                    request_id=seq.request_id,
                    token_ids=seq.all_token_ids(),
                    num_prompt_tokens=seq.num_prompt_tokens,
                    block_ids=worker.blocks.block_table(seq.request_id),
                    num_computed_tokens=seq.num_computed_tokens,
                    num_scheduled_tokens=num_new,
                    sampling=seq.request.sampling,
                    trace_context=seq.request.trace_context,
                )
            )
            self._advance(seq, num_new, draft)

    def _pick_worker(self, drafts: dict[str, _PlanDraft]) -> WorkerState | None:
        """The worker with the most free blocks among those that can take another sequence now."""
        eligible = [
            w
            for w in self._workers.values()
            if not drafts[w.worker_id].preempted
            and drafts[w.worker_id].token_budget > 0
            and len(w.running) < self.config.max_num_seqs
        ]
        return max(eligible, key=lambda w: w.blocks.num_free_blocks, default=None)

    def _fits_any_worker(self, seq: Sequence) -> bool:
        """Rejects (finishes with an error) a sequence no worker could ever hold; True if it fits."""
        if not self._workers:
            return True  # wait for workers to register
        capacity = max(w.blocks.num_blocks for w in self._workers.values()) * self.config.block_size
        if seq.max_slots <= capacity:
            return True
        error = RequestError(
            GRPC_RESOURCE_EXHAUSTED,
            f"the request needs {seq.max_slots} KV slots (prompt + max_tokens), "
            f"more than the largest worker's {capacity}",
        )
        self._finish(seq, FinishReason.ABORT)
        self._outputs.append(RequestOutput(seq.request_id, seq.num_output_tokens, (), FinishReason.ABORT, error))
        return False

    # ---- state changes -------------------------------------------------------------------
    @staticmethod
    def _advance(seq: Sequence, num_new: int, draft: _PlanDraft) -> None:
        seq.num_computed_tokens += num_new
        draft.token_budget -= num_new

    def _preempt(self, seq: Sequence) -> None:
        """Recompute preemption: frees the blocks; the sequence waits at the front of the queue."""
        self._num_preemptions += 1
        seq.num_preemptions += 1
        self._requeue_front(seq)

    def _requeue_front(self, seq: Sequence) -> None:
        worker = self._workers.get(seq.worker_id) if seq.worker_id else None
        if worker is not None:
            worker.blocks.free(seq.request_id)
            worker.running.pop(seq.request_id, None)
            worker.dropped_ids.append(seq.request_id)
        seq.status, seq.worker_id, seq.num_computed_tokens = SequenceStatus.WAITING, None, 0
        self._waiting[seq.request_id] = seq
        self._waiting.move_to_end(seq.request_id, last=False)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Marks a sequence finished and frees its blocks in this iteration."""
        if seq.status is SequenceStatus.RUNNING and seq.worker_id in self._workers:
            worker = self._workers[seq.worker_id]
            worker.blocks.free(seq.request_id)
            del worker.running[seq.request_id]
            worker.dropped_ids.append(seq.request_id)
        self._waiting.pop(seq.request_id, None)
        seq.status, seq.finish_reason, seq.worker_id = SequenceStatus.FINISHED, reason, None
        del self._sequences[seq.request_id]
