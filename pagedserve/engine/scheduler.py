"""Iteration-level scheduling (Orca, Yu et al., OSDI 2022, §3) over paged KV blocks (vLLM).

Each iteration, per worker: running sequences that decode get their token first, then running
sequences in the middle of a chunked prefill get the next chunk; when blocks run out, the last
running sequence in the policy's order is preempted (by recompute, or by swapping its blocks to
CPU memory). Prefill chunks beside decodes are sized so that the step stays within
``max_decode_slowdown`` times the decodes' own time (``step_cost``, ``PlanDraft.chunk_tokens``). Then swapped-out sequences come back, and waiting sequences are admitted in the
policy's order onto the worker that holds most of their prompt's prefix, balanced against its
load (or the one with the most free blocks: ``SchedulerConfig.placement``), taking cached prefix
blocks first, under ``max_num_seqs`` and the ``max_num_batched_tokens`` budget.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Mapping, Sequence as Seq

from pagedserve.engine.block_manager import NO_PREFIX
from pagedserve.engine.config import PreemptionMode, SchedulerConfig, SchedulerStats
from pagedserve.engine.messages import (CachedRequestData, EngineRequest, FinishReason, RequestError, ResumedSample,
                                        SampledToken, SequenceId, StepResult)
from pagedserve.engine.outputs import RequestOutput, SchedulerOutput
from pagedserve.engine.limits import num_new_tokens, rejection_error, worker_loss_error
from pagedserve.engine.parallel_sampling import Forks
from pagedserve.engine.policy import POLICIES
from pagedserve.engine.request_resume import check_resumed, resumed_sequences, starts_fresh
from pagedserve.engine.sequence import Sequence, SequenceStatus
from pagedserve.engine.worker_state import PlanDraft, WorkerState, pick_worker, scheduler_stats


class Scheduler:
    """Owns the sequences, the waiting queue and one block manager per worker.

    Each worker runs its own step pipeline: ``schedule`` drafts plans for the workers it is given
    (those not busy with a step), and ``update_from_output`` applies one worker's result whenever
    it arrives, so a slow worker never holds back another.

    Not thread-safe: one thread calls it (the engine loop).
    """

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self._policy = POLICIES[config.policy]
        self._workers: dict[str, WorkerState] = {}
        self._sequences: dict[SequenceId, Sequence] = {}
        self._waiting = self._policy.make_queue()
        self._forks = Forks()
        self._outputs: list[RequestOutput] = []  # made while scheduling, returned by schedule()
        self._step_id = 0
        self._num_preemptions = 0
        self._num_swap_preemptions = 0

    # ---- workers -------------------------------------------------------------------------
    def add_worker(self, worker_id: str, num_blocks: int, num_cpu_blocks: int = 0) -> None:
        """Registers a worker with ``num_blocks`` KV blocks (and CPU blocks for swapping).

        Raises:
            ValueError: the id is already registered.
        """
        if worker_id in self._workers:
            raise ValueError(f"worker {worker_id!r} is already registered")
        self._workers[worker_id] = WorkerState(worker_id, num_blocks, num_cpu_blocks, self.config)

    def remove_worker(self, worker_id: str) -> list[RequestOutput]:
        """Forgets a worker (gone or failed); its sequences go back to the front of the queue and
        are recomputed elsewhere (or on the same worker when it is admitted again).

        Returns:
            Final outputs of the sequences that end instead (``limits.worker_loss_error``).
        """
        worker = self._workers.pop(worker_id, None)
        for seq in self._sequences.values():
            if seq.in_flight_worker_id == worker_id:
                seq.tokens_lost()
        outputs: list[RequestOutput] = []
        for seq in reversed([*worker.running.values(), *worker.swapped.values()] if worker else []):
            seq.num_worker_losses += 1
            self._requeue(seq)
            if (error := worker_loss_error(seq)) is not None:
                outputs += self.abort_sample(seq.seq_id, error)
        return outputs

    @property
    def worker_ids(self) -> list[str]:
        return list(self._workers)

    def block_manager(self, worker_id: str):
        return self._workers[worker_id].blocks

    def session_id(self, worker_id: str) -> str | None:
        """The session the worker's plans carry now (new at every ``add_worker``); None if unknown."""
        worker = self._workers.get(worker_id)
        return worker.session_id if worker else None

    def requests_on(self, worker_id: str) -> list[SequenceId]:
        """The sequences running on a worker."""
        return list(self._workers[worker_id].running)

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, request: EngineRequest) -> None:
        """Queues a request.

        Raises:
            ValueError: a request with this id is already in flight.
        """
        if self.has_request(request.request_id):
            raise ValueError(f"request {request.request_id!r} is already in flight")
        seq = Sequence(request)
        self._sequences[seq.seq_id] = seq
        self._waiting.push(seq)

    def resume_request(self, request: EngineRequest, resumed: Seq[ResumedSample]) -> None:
        """Takes over a request another scheduler ran, continuing from the tokens already delivered
        (request migration, as NVIDIA Dynamo's): ``resumed`` lists them per sample; finished samples
        do not run again, the others wait like recompute-preempted ones (see ``request_resume``).

        Raises:
            ValueError: the request is in flight, or ``resumed`` does not fit it; nothing changes then.
        """
        if self.has_request(request.request_id):
            raise ValueError(f"request_id: request {request.request_id!r} is already in flight")
        check_resumed(request, resumed)
        if starts_fresh(resumed):
            return self.add_request(request)
        sequences = resumed_sequences(request, resumed)
        for seq in reversed(sequences):  # each goes to the front: sample 0 ends up first
            self._sequences[seq.seq_id] = seq
            self._waiting.push_preempted(seq)
        self._forks.adopt(request, sequences)

    def abort_request(self, request_id: str, error: RequestError | None = None) -> list[RequestOutput]:
        """Finishes every sample of a request now and frees their blocks.

        Returns:
            The final output (reason ``abort``, with ``error`` if given) of every sample that was
            in flight; empty if none was.
        """
        outputs = self._abort(self._forks.sequence_ids(request_id) or [SequenceId(request_id, 0)], error)
        self._forks.forget(request_id)
        return outputs

    def abort_sample(self, seq_id: SequenceId, error: RequestError | None = None) -> list[RequestOutput]:
        """Finishes one sample of a request now (the others go on); as :meth:`abort_request`."""
        return self._abort([seq_id], error)

    def _abort(self, ids: list[SequenceId], error: RequestError | None) -> list[RequestOutput]:
        found = [self._sequences[i] for i in ids if i in self._sequences]
        for seq in found:
            self._finish(seq, FinishReason.ABORT)
        return [RequestOutput.aborted(seq.request_id, error, sample_index=seq.sample_index,
                                      first_output_index=seq.num_output_tokens) for seq in found]

    def has_request(self, request_id: str) -> bool:
        """Whether any sample of request ``request_id`` is still in flight."""
        return SequenceId(request_id, 0) in self._sequences or self._forks.knows(request_id)

    def waiting_requests(self) -> list[str]:
        """Ids of the requests with a sample waiting to be admitted, in queue order."""
        return list(dict.fromkeys(seq.request_id for seq in self._waiting))

    def has_unfinished_requests(self) -> bool:
        """Requests in flight."""
        return bool(self._sequences)

    def has_work(self) -> bool:
        """Unfinished requests, or workers still to be told to drop finished requests' state."""
        return self.has_unfinished_requests() or any(w.dropped_ids for w in self._workers.values())

    def sequence(self, seq_id: SequenceId) -> Sequence:
        """The in-flight sequence with this id. Raises KeyError if none."""
        return self._sequences[seq_id]

    # ---- one iteration -------------------------------------------------------------------
    def schedule(self, worker_ids: Collection[str]) -> SchedulerOutput:
        """Decides what runs next on each of ``worker_ids`` (unknown ids are ignored), with which
        blocks; waiting requests are admitted onto these workers only."""
        self._step_id += 1
        workers = [self._workers[w] for w in worker_ids if w in self._workers]
        drafts = {w.worker_id: w.new_draft() for w in workers}
        for worker in workers:
            self._schedule_running(worker, drafts[worker.worker_id])
            worker.swap_in(drafts[worker.worker_id], self.config.max_num_seqs)
        self._schedule_waiting(drafts)
        plans = {w.worker_id: w.take_plan(drafts[w.worker_id]) for w in workers if w.has_plan(drafts[w.worker_id])}
        outputs, self._outputs = tuple(self._outputs), []
        return SchedulerOutput(plans, outputs)

    def update_from_output(self, results: Mapping[str, StepResult]) -> list[RequestOutput]:
        """Applies sampled tokens; finished sequences free their blocks now.

        Returns:
            One output per sample that got a token or finished.
        """
        outputs = []
        for worker_id, result in results.items():
            if (worker := self._workers.get(worker_id)) is not None:
                worker.step_answered(result.step_id)
            for chunk in result.prompt_logprobs:
                if (seq := self._sequences.get(chunk.seq_id)) is not None:
                    seq.add_prompt_logprobs(chunk)
            # forked samples first: they fork from sample 0, which may finish on its own token
            for sampled in sorted(result.sampled, key=lambda s: s.sample_index == s.seq_id.sample_index):
                seq = self._sequences.get(sampled.seq_id)
                if seq is None or not seq.expects(worker_id, result.step_id):
                    continue  # aborted while the step ran (and maybe taken again since), or its worker dropped
                if sampled.sample_index != seq.sample_index:
                    seq = self._forks.add_child(seq, sampled.sample_index, self._sequences, self._waiting)
                else:
                    seq.token_arrived()  # even if preempted meanwhile: the token was computed right
                outputs.append(self._append(seq, sampled))
        return outputs

    def cached_block_digests(self) -> frozenset[bytes]:
        """Content hashes of the prompt blocks cached on any worker (what peers route by)."""
        return frozenset(d for worker in self._workers.values() for d in worker.blocks.cached_digests())

    def stats(self) -> SchedulerStats:
        return scheduler_stats(self._workers.values(), len(self._waiting), self._step_id, self._num_preemptions,
                               self._num_swap_preemptions)

    # ---- policy pieces -------------------------------------------------------------------
    def _schedule_running(self, worker: WorkerState, draft: PlanDraft) -> None:
        """Decodes first, then prefill chunks, each in the policy's order; preempts from the back.
        A sequence whose tokens in flight must be known first (``Sequence.can_run_ahead``) waits."""
        ordered = [s for s in self._policy.running_order(worker.running) if s.can_run_ahead()]
        queue = deque([s for s in ordered if s.num_uncomputed_tokens == 1] +
                      [s for s in ordered if s.num_uncomputed_tokens > 1])
        while queue and draft.token_budget > 0:
            seq = queue.popleft()
            num_new = num_new_tokens(seq, draft, self.config)
            if num_new == 0:
                continue
            total = seq.num_computed_tokens + num_new
            needed = worker.blocks.num_new_blocks(seq.seq_id, total)
            while needed > worker.blocks.num_free_blocks:
                if not queue and len(worker.running) == 1:
                    if not seq.num_tokens_in_flight:  # else its last token may still end it: ask again then
                        self._out_of_memory(seq)  # alone, and the whole cache is its: like the end of the context
                    break
                victim = queue.pop() if queue else seq
                self._preempt(worker, victim, draft)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING or needed > worker.blocks.num_free_blocks:
                continue
            new_block_ids = worker.blocks.allocate_blocks(seq.seq_id, needed) if needed else ()
            draft.cached_requests.append(
                CachedRequestData(seq.seq_id, new_block_ids, seq.num_computed_tokens, num_new))
            worker.advance(seq, num_new, draft)

    def _schedule_waiting(self, drafts: dict[str, PlanDraft]) -> None:
        """Admits waiting sequences in the policy's order until one does not fit."""
        while len(self._waiting):
            seq = self._waiting.peek()
            if seq.num_tokens_in_flight:
                return  # preempted while a step of it ran: it is sent in full once all its tokens are known
            if not self._fits_any_worker(seq):
                continue  # rejected and removed from the queue
            worker = self._place(seq, drafts)
            if worker is None:
                return
            draft = drafts[worker.worker_id]
            if self._forks.try_fork(seq, worker, draft, self._sequences):
                self._waiting.remove(seq.seq_id)
                worker.start(seq, draft, num_new=1)
                continue
            # prompt logprobs need every prompt position computed: no cached prefix (as vLLM)
            prefix = worker.cached_prefix(seq) if seq.sampling.prompt_logprobs is None else NO_PREFIX
            num_new = num_new_tokens(seq, draft, self.config, prefix.num_tokens)
            total = prefix.num_tokens + num_new
            if num_new == 0 or not worker.blocks.can_allocate(seq.seq_id, total, prefix):
                return
            worker.blocks.allocate_slots(seq.seq_id, total, prefix)
            self._waiting.remove(seq.seq_id)
            seq.num_computed_tokens = prefix.num_tokens
            worker.start(seq, draft, num_new)

    def _place(self, seq: Sequence, drafts: dict[str, PlanDraft]) -> WorkerState | None:
        """Where to admit ``seq`` now, among the workers being scheduled (``drafts``): a forked
        sample on its parent's worker, anything else where ``pick_worker`` places it; None (it
        waits) when that worker is busy with a step or none can take it."""
        parent = seq.fork_parent
        if parent is not None and parent.status is SequenceStatus.RUNNING:
            workers = [self._workers[parent.worker_id]]
        else:
            workers = list(self._workers.values())
        worker = pick_worker(workers, drafts, self.config, seq)
        return worker if worker is not None and worker.worker_id in drafts else None

    def _fits_any_worker(self, seq: Sequence) -> bool:
        """Ends (with RESOURCE_EXHAUSTED) a sequence no worker could ever run; True if it fits."""
        error = rejection_error(seq, [w.blocks.num_blocks for w in self._workers.values()], self.config)
        if error is not None:
            self._outputs += self.abort_sample(seq.seq_id, error)
        return error is None

    # ---- state changes -------------------------------------------------------------------
    def _append(self, seq: Sequence, sampled: SampledToken) -> RequestOutput:
        """Appends a sampled token; its output carries the logprobs asked for, the prompt's with
        sample 0's first token, and the stop token id when one from ``stop_token_ids`` ended it."""
        index, token_id = seq.num_output_tokens, sampled.token_id
        prompt_logprobs = seq.take_prompt_logprobs()
        reason = seq.append_token(token_id)
        if reason is not None:
            self._finish(seq, reason)
        elif seq.status is SequenceStatus.RUNNING:
            self._workers[seq.worker_id].cache_full_blocks(seq)  # a block may have waited for this token
        stop_token_id = seq.sampling.stop_token_id(token_id) if reason is FinishReason.STOP else None
        logprobs = (sampled.logprobs,) if sampled.logprobs is not None else ()
        return RequestOutput(request_id=seq.request_id, first_output_index=index, new_token_ids=(token_id,),
                             finish_reason=reason, sample_index=seq.sample_index, logprobs=logprobs,
                             prompt_logprobs=prompt_logprobs, stop_token_id=stop_token_id)

    def _out_of_memory(self, seq: Sequence) -> None:
        """Finishes a sequence that fills its worker's whole cache, with reason ``length``."""
        self._finish(seq, FinishReason.LENGTH)
        self._outputs.append(RequestOutput(request_id=seq.request_id, first_output_index=seq.num_output_tokens,
                                           finish_reason=FinishReason.LENGTH, sample_index=seq.sample_index))

    def _preempt(self, worker: WorkerState, seq: Sequence, draft: PlanDraft) -> None:
        """Takes a running sequence's blocks back: swap when asked and possible, else recompute."""
        self._num_preemptions += 1
        seq.num_preemptions += 1
        draft.preempted = True  # no admissions on this worker in this iteration
        if self.config.preemption_mode is PreemptionMode.SWAP and worker.blocks.can_swap_out(seq.seq_id):
            self._num_swap_preemptions += 1
            worker.swap_out(seq, draft)
            return
        self._requeue(seq)

    def _requeue(self, seq: Sequence) -> None:
        """Recompute preemption: frees the blocks; the sequence waits ahead of later arrivals."""
        worker = self._workers.get(seq.worker_id) if seq.worker_id else None
        if worker is not None:
            worker.release(seq.seq_id)
        seq.status, seq.worker_id, seq.num_computed_tokens = SequenceStatus.WAITING, None, 0
        self._waiting.push_preempted(seq)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Marks a sequence finished and frees its blocks in this iteration."""
        worker = self._workers.get(seq.worker_id) if seq.worker_id else None
        if worker is not None:
            worker.release(seq.seq_id)
        self._waiting.remove(seq.seq_id)
        seq.status, seq.finish_reason, seq.worker_id = SequenceStatus.FINISHED, reason, None
        del self._sequences[seq.seq_id]
        self._forks.finished(seq)
