"""Iteration-level scheduling (Orca, Yu et al., OSDI 2022, §3) over paged KV blocks (vLLM).

Each iteration, per worker: decodes first, then the next chunks of chunked prefills (sized so the
step stays within ``max_decode_slowdown`` times the decodes' own time: ``step_cost``); when blocks
run out, the last running sequence in the policy's order is preempted (recompute, or swap to CPU):
``running_schedule``. Then swapped-out sequences come back, and waiting ones are admitted in the
policy's order onto the worker that holds most of their prompt's prefix, balanced against its load
(``worker_pool``), under ``max_num_seqs`` and the ``max_num_batched_tokens`` budget.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence as Seq
from functools import partial

from pagedserve.engine.admission import AdmissionHeadroom
from pagedserve.engine.admission_order import passing_head, queue_head
from pagedserve.engine.block_manager import NO_PREFIX
from pagedserve.engine.config import SchedulerConfig, SchedulerStats
from pagedserve.engine.messages import (EngineRequest, FinishReason, RequestError, ResumedSample, SampledToken,
                                        SequenceId, StepResult)
from pagedserve.engine.outputs import RequestOutput, SchedulerOutput
from pagedserve.engine.limits import LOST_TOKEN_ERROR, grammar_failure, num_new_tokens, worker_loss_error
from pagedserve.engine.policy import POLICIES
from pagedserve.engine.requests_in_flight import RequestsInFlight
from pagedserve.engine.running_schedule import RunningSchedule
from pagedserve.engine.sequence import Sequence, SequenceStatus
from pagedserve.engine.spec_decode.config import SpeculativeConfig
from pagedserve.engine.spec_decode.counters import SpecDecodeCounters
from pagedserve.engine.spec_decode.lookahead import settle_drafts
from pagedserve.engine.worker_pool import WorkerPool
from pagedserve.engine.worker_state import PlanDraft, WorkerState


class Scheduler:
    """Decides each iteration's plans over the requests in flight (``requests_in_flight``) and the
    workers (``worker_pool``), and applies the workers' results to them.

    Each worker runs its own step pipeline: ``schedule`` drafts plans for the workers it is given
    (those not busy with a step), and ``update_from_output`` applies one worker's result whenever
    it arrives, so a slow worker never holds back another.

    Not thread-safe: one thread calls it (the engine loop).
    """

    def __init__(self, config: SchedulerConfig, speculative: SpeculativeConfig = SpeculativeConfig()) -> None:
        self.config = config
        self.speculative = speculative
        # drafts verified and accepted so far (None: this scheduler does not speculate)
        k = speculative.num_lookahead_tokens
        self.spec_decode = SpecDecodeCounters.zero(k) if k else None
        policy = self._policy = POLICIES[config.policy]
        # a shorter prompt may pass a head that waits for an earlier prompt's chunks (admission_order)
        self._next_admission = passing_head if config.short_prompt_share > 0 else queue_head
        self._workers = WorkerPool(config)
        self._requests = RequestsInFlight(policy)
        self._outputs: list[RequestOutput] = []  # made while scheduling, returned by schedule()
        self._step_id = 0
        self._running = RunningSchedule(config, speculative, policy, self._workers, self._requests)
        self._headroom = AdmissionHeadroom(config.admission_headroom)

    # ---- workers -------------------------------------------------------------------------
    def add_worker(self, worker_id: str, num_blocks: int, num_cpu_blocks: int = 0, device: str = "cpu") -> None:
        """Registers a worker; as :meth:`WorkerPool.add` (ValueError if the id is registered)."""
        self._workers.add(worker_id, num_blocks, num_cpu_blocks, device)

    def remove_worker(self, worker_id: str) -> list[RequestOutput]:
        """Forgets a worker (gone or failed); its sequences go back to the front of the queue and
        are recomputed elsewhere (or on the same worker when it is admitted again).

        Returns:
            Final outputs of the sequences that end instead (``limits.worker_loss_error``).
        """
        lost = self._workers.remove(worker_id)
        self._requests.tokens_lost_on(worker_id)
        outputs: list[RequestOutput] = []
        for seq in lost:
            seq.num_worker_losses += 1
            self._running.requeue(seq)
            if (error := worker_loss_error(seq)) is not None:
                outputs += self.abort_sample(seq.seq_id, error)
        return outputs

    @property
    def worker_ids(self) -> list[str]:
        return self._workers.ids

    def block_manager(self, worker_id: str):
        return self._workers[worker_id].blocks

    def session_id(self, worker_id: str) -> str | None:
        """The session the worker's plans carry now (new at every ``add_worker``); None if unknown."""
        return self._workers.session_id(worker_id)

    def sequences_on(self, worker_id: str) -> list[SequenceId]:
        """The sequences running on a worker."""
        return self._workers.sequences_on(worker_id)

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, request: EngineRequest) -> None:
        """Queues a request; as :meth:`RequestsInFlight.add` (ValueError if it is in flight)."""
        self._requests.add(request)

    def resume_request(self, request: EngineRequest, resumed: Seq[ResumedSample]) -> None:
        """Takes over a request another scheduler ran, from the tokens already delivered; as
        :meth:`RequestsInFlight.resume` (ValueError if it is in flight or ``resumed`` does not fit)."""
        self._requests.resume(request, resumed)

    def hold_request(self, request_id: str) -> None:
        """Keeps a queued request from admission until :meth:`release_request` (``RequestsInFlight.hold``)."""
        self._requests.hold(request_id)

    def release_request(self, request_id: str) -> None:
        """Queues a held request for admission (nothing if it is not held: aborted meanwhile)."""
        self._requests.release(request_id)

    def abort_request(self, request_id: str, error: RequestError | None = None) -> list[RequestOutput]:
        """Finishes every sample of a request now and frees their blocks; returns the final output
        (reason ``abort``, with ``error`` if given) of each sample that was in flight."""
        outputs = self._abort(self._requests.sample_ids(request_id), error)
        self._requests.forget(request_id)
        return outputs

    def abort_sample(self, seq_id: SequenceId, error: RequestError | None = None) -> list[RequestOutput]:
        """Finishes one sample of a request now (the others go on); as :meth:`abort_request`."""
        return self._abort([seq_id], error)

    def _abort(self, ids: list[SequenceId], error: RequestError | None) -> list[RequestOutput]:
        found = [self._requests.sequences[i] for i in ids if i in self._requests.sequences]
        for seq in found:
            self._finish(seq, FinishReason.ABORT)
        return [RequestOutput.aborted(seq.request_id, error, sample_index=seq.sample_index,
                                      first_output_index=seq.num_output_tokens) for seq in found]

    def has_request(self, request_id: str) -> bool:
        """Whether any sample of request ``request_id`` is still in flight."""
        return self._requests.has_request(request_id)

    def waiting_requests(self) -> list[str]:
        """As :meth:`RequestsInFlight.waiting_requests`."""
        return self._requests.waiting_requests()

    def has_unfinished_requests(self) -> bool:
        """Requests in flight."""
        return bool(self._requests.sequences)

    def has_work(self) -> bool:
        """Unfinished requests, or workers still to be told to drop finished requests' state."""
        return self.has_unfinished_requests() or self._workers.has_drops()

    def sequence(self, seq_id: SequenceId) -> Sequence:
        """The in-flight sequence with this id. Raises KeyError if none."""
        return self._requests.sequences[seq_id]

    # ---- one iteration -------------------------------------------------------------------
    def schedule(self, worker_ids: Collection[str]) -> SchedulerOutput:
        """Decides what runs next on each of ``worker_ids`` (unknown ids are ignored), with which
        blocks; waiting requests are admitted onto these workers only."""
        self._step_id += 1
        num_preemptions = self._running.num_preemptions
        drafts = self._workers.new_drafts(worker_ids)
        for worker_id, draft in drafts.items():
            worker = self._workers[worker_id]
            fills_cache = self._running.schedule(worker, draft, partial(self._admissible_next, worker, drafts))
            if fills_cache is not None:
                self._out_of_memory(fills_cache)  # alone, and the whole cache is its: like the end of the context
            worker.swap_in(draft, self.config.max_num_seqs)
        self._schedule_waiting(drafts)
        self._headroom.end_iteration(self._running.num_preemptions - num_preemptions)
        plans = self._workers.take_plans(drafts)
        outputs, self._outputs = tuple(self._outputs), []
        return SchedulerOutput(plans, outputs)

    def update_from_output(self, results: Mapping[str, StepResult]) -> list[RequestOutput]:
        """Applies sampled tokens (each worker's answers in the order of its steps); finished
        sequences free their blocks now; so do those whose token the answer lacks (``LOST_TOKEN_ERROR``).

        Returns:
            One output per sample that got a token or finished.
        """
        outputs = []
        for worker_id, result in results.items():
            expected = self._workers.step_answered(worker_id, result)  # the sequences the step samples for
            if self.spec_decode is not None:
                self.spec_decode += SpecDecodeCounters.of(result.sampled)
            for chunk in result.prompt_logprobs:
                if (seq := self._requests.sequences.get(chunk.seq_id)) is not None:
                    seq.add_prompt_logprobs(chunk)
            # forked samples first: they fork from sample 0, which may finish on its own token
            for sampled in sorted(result.sampled, key=lambda s: s.sample_index == s.seq_id.sample_index):
                seq = self._requests.sequences.get(sampled.seq_id)
                if seq is None or not seq.expects(worker_id, result.step_id):
                    continue  # aborted while the step ran (and maybe taken again since), or its worker dropped
                if sampled.sample_index != seq.sample_index:
                    seq = self._requests.add_child(seq, sampled.sample_index)
                else:
                    seq.token_arrived()  # even if preempted meanwhile: the token was computed right
                if sampled.grammar_error is not None:  # the token is not the structure's: the sample ends
                    outputs += self.abort_sample(seq.seq_id, grammar_failure(sampled.grammar_error))
                    continue
                outputs.append(self._append(seq, sampled))
            for seq in self._requests.missing_from_answer(worker_id, result.step_id, expected):  # none will come
                outputs += self.abort_sample(seq.seq_id, LOST_TOKEN_ERROR)
        return outputs

    def cached_block_digests(self) -> frozenset[bytes]:
        """Content hashes of the prompt blocks cached on any worker (what peers route by)."""
        return self._workers.cached_digests()

    def stats(self) -> SchedulerStats:
        return self._workers.stats(self._requests.num_waiting, self._step_id, self._running.num_preemptions,
                                   self._running.num_swap_preemptions, self.spec_decode)

    # ---- policy pieces -------------------------------------------------------------------
    def _admissible_next(self, worker: WorkerState, drafts: dict[str, PlanDraft]) -> Sequence | None:
        """The waiting sequence admission takes next (``admission_order``) if it would be admitted on ``worker``
        now: placed there (``WorkerPool.place``: not a worker at ``max_num_seqs``, a fork's parent's), and a
        fork (one token beside its parent's blocks) or a prompt in its free blocks with room kept for the
        running sequences' growth (``admission``); else None. The chunks of the prompts running there leave it
        what it needs, up to a share of the step (``RunningSchedule._prefill_share``)."""
        if not len(self._requests.waiting):
            return None
        seq, placed = self._next_admission(self._requests.waiting, self._policy, self._workers, drafts)
        if seq.num_tokens_in_flight or placed is not worker:
            return None
        if seq.fork_parent is not None:
            return seq
        kept = self._headroom.kept_blocks(worker.blocks, worker.running.values())
        return seq if self._headroom.admits(worker.blocks, seq, seq.num_tokens, NO_PREFIX, kept,
                                            len(worker.running)) else None

    def _schedule_waiting(self, drafts: dict[str, PlanDraft]) -> None:
        """Admits waiting sequences in the policy's order, but for shorter prompts passing a head that waits
        for an earlier prompt's chunks (``admission_order``), until one does not fit, with room left for the
        running sequences' growth (``admission``)."""
        waiting = self._requests.waiting
        kept: dict[str, int] = {}  # per worker: free blocks kept for its running sequences' growth
        while len(waiting):
            seq, worker = self._next_admission(waiting, self._policy, self._workers, drafts)
            if seq.num_tokens_in_flight:
                return  # preempted while a step of it ran: it is sent in full once all its tokens are known
            if self._refused_as_too_large(seq):
                continue  # ended, and removed from the queue
            if worker is None:
                return
            draft = drafts[worker.worker_id]
            if self._requests.try_fork(seq, worker, draft):
                waiting.remove(seq.seq_id)
                worker.start(seq, draft, num_new=1)
                continue
            # prompt logprobs need every prompt position computed: no cached prefix (as vLLM)
            prefix = worker.cached_prefix(seq) if seq.sampling.prompt_logprobs is None else NO_PREFIX
            num_new = num_new_tokens(seq, draft, self.config, prefix.num_tokens)
            total = prefix.num_tokens + num_new
            if worker.worker_id not in kept:
                kept[worker.worker_id] = self._headroom.kept_blocks(worker.blocks, worker.running.values())
            if num_new == 0 or not self._headroom.admits(worker.blocks, seq, total, prefix, kept[worker.worker_id],
                                                         len(worker.running)):
                return
            worker.blocks.allocate_slots(seq.seq_id, total, prefix)
            waiting.remove(seq.seq_id)
            seq.num_computed_tokens = prefix.num_tokens
            worker.start(seq, draft, num_new)
            kept[worker.worker_id] += worker.blocks.num_new_blocks(seq.seq_id, self._headroom.target_tokens(seq))

    def _refused_as_too_large(self, seq: Sequence) -> bool:
        """Ends (with RESOURCE_EXHAUSTED) a sequence no worker could ever run, and says whether it did."""
        error = self._workers.rejection_error(seq)
        if error is not None:
            self._outputs += self.abort_sample(seq.seq_id, error)
        return error is not None

    # ---- state changes -------------------------------------------------------------------
    def _append(self, seq: Sequence, sampled: SampledToken) -> RequestOutput:
        """Appends the accepted drafts then the sampled token, one by one until one ends the
        sequence; the output carries the logprobs asked for, the prompt's with sample 0's first
        token, and the stop token id when one from ``stop_token_ids`` ended it."""
        index, prompt_logprobs = seq.num_output_tokens, seq.take_prompt_logprobs()
        tokens = (*sampled.accepted, sampled)
        count, reason = seq.append_tokens([t.token_id for t in tokens])
        if seq.status is SequenceStatus.RUNNING:
            if seq.num_lookahead_slots:
                settle_drafts(seq, len(sampled.accepted), self._workers[seq.worker_id].blocks)
            self._workers[seq.worker_id].cache_full_blocks(seq)  # a block may have waited for these tokens
        if reason is not None:
            self._finish(seq, reason)
        stop_token_id = seq.sampling.stop_token_id(tokens[count - 1].token_id) if reason is FinishReason.STOP else None
        return RequestOutput.emitted(seq.request_id, seq.sample_index, index, tokens[:count], reason, stop_token_id,
                                     prompt_logprobs)

    def _out_of_memory(self, seq: Sequence) -> None:
        """Finishes a sequence that fills its worker's whole cache, with reason ``length``."""
        self._finish(seq, FinishReason.LENGTH)
        self._outputs.append(RequestOutput(request_id=seq.request_id, first_output_index=seq.num_output_tokens,
                                           finish_reason=FinishReason.LENGTH, sample_index=seq.sample_index))

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Marks a sequence finished and frees its blocks in this iteration."""
        self._workers.release(seq)
        self._requests.finish(seq, reason)
