"""The running sequences' share of one worker's iteration, and preemption.

Decodes first, then the next chunks of chunked prefills, each group in the policy's order, under the
step's token budget (Sarathi-Serve's stall-free batching). When the worker's blocks run out, the last
running sequence in that order is preempted (vLLM, Kwon et al. 2023, §4.5): by recompute (its blocks are
freed; it waits ahead of later arrivals and is prefilled again) or by swap (``--preemption-mode swap``:
its blocks go to the worker's CPU blocks and come back later; recompute when they run out).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from pagedserve.engine.config import PreemptionMode, SchedulerConfig
from pagedserve.engine.limits import num_new_tokens
from pagedserve.engine.messages import CachedRequestData
from pagedserve.engine.policy import Policy
from pagedserve.engine.requests_in_flight import RequestsInFlight
from pagedserve.engine.sequence import Sequence, SequenceStatus
from pagedserve.engine.spec_decode.config import SpeculativeConfig, SpeculativeControl
from pagedserve.engine.spec_decode.goodput import best_lookahead
from pagedserve.engine.spec_decode.lookahead import (lookahead_slots, repeats_draws, sequence_lookahead,
                                                    waits_for_answer)
from pagedserve.engine.worker_pool import WorkerPool
from pagedserve.engine.worker_state import PlanDraft, WorkerState


class RunningSchedule:
    """Schedules the running sequences of the workers in ``workers`` (requeueing preempted ones into
    ``requests``), with ``speculative``'s lookahead (``SpeculativeControl``).

    Attributes:
        num_preemptions: sequences preempted so far, either way.
        num_swap_preemptions: those of them swapped out.
    """

    def __init__(self, config: SchedulerConfig, speculative: SpeculativeConfig, policy: Policy, workers: WorkerPool,
                 requests: RequestsInFlight) -> None:
        self.config = config
        self.speculative = speculative
        self._policy = policy
        self._workers = workers
        self._requests = requests
        self.num_preemptions = 0
        self.num_swap_preemptions = 0

    def schedule(self, worker: WorkerState, draft: PlanDraft,
                 admissible_waiting: Callable[[], Sequence | None]) -> Sequence | None:
        """Decodes first, then prefill chunks, each in the policy's order; preempts from the back.
        A sequence whose tokens in flight must be known first (``Sequence.can_run_ahead``, or to
        speculate: ``lookahead.waits_for_answer``) waits. ``admissible_waiting``: the waiting
        sequence admission takes next if it could be admitted on this worker after them, else None
        (``Scheduler._admissible_next``, for ``_prefill_share``; asked only when a prompt is being prefilled here).

        Returns:
            The sequence alone on the worker whose blocks fill its whole cache, with no token in flight:
            it is to end with reason ``length``, as at the end of the context. None if there is none.
        """
        schedulable = [s for s in self._policy.running_order(worker.running) if s.can_run_ahead()]
        step_k, most = self._lookahead(worker, schedulable, draft.token_budget), self.speculative.num_lookahead_tokens
        ordered = [s for s in schedulable if not waits_for_answer(s, sequence_lookahead(s, step_k, most))]
        prefills = [s for s in ordered if s.num_uncomputed_tokens > 1]
        queue = deque([s for s in ordered if s.num_uncomputed_tokens == 1] + prefills)
        yielding = self._yielding(prefills)
        waiting = admissible_waiting() if prefills and self.config.short_prompt_share > 0 else None
        while queue and draft.token_budget > 0:
            seq = queue.popleft()
            if seq.num_uncomputed_tokens == 1:
                num_new = 1  # a decode: the budget has a token left
            else:
                share, reserve = self._prefill_share(seq, draft, yielding, waiting)
                num_new = num_new_tokens(seq, draft, self.config, share=share, reserve=reserve)
                if num_new == 0:
                    continue
            k = sequence_lookahead(seq, step_k, most)
            lookahead = lookahead_slots(seq, num_new, k, worker.blocks, draft.token_budget)
            total = seq.num_computed_tokens + num_new + lookahead
            needed = worker.blocks.num_new_blocks(seq.seq_id, total)
            if needed > worker.blocks.num_free_blocks:
                if not self._make_room(worker, seq, needed, queue, draft):
                    # alone, and nothing left to preempt (the queue is empty: this is the pass's last sequence)
                    return None if seq.num_tokens_in_flight else seq  # its last token in flight may still end it
                if seq.status is not SequenceStatus.RUNNING or needed > worker.blocks.num_free_blocks:
                    continue
            new_block_ids = worker.blocks.allocate_blocks(seq.seq_id, needed) if needed else ()
            draft.cached_requests.append(
                CachedRequestData(seq.seq_id, new_block_ids, seq.num_computed_tokens, num_new, lookahead))
            worker.advance(seq, num_new, draft, lookahead)
        return None

    def _yielding(self, prefills: list[Sequence]) -> dict[Sequence, int]:
        """The prompts being prefilled that a shorter one scheduled after them in this step, of their precedence
        or an earlier one (``Policy.precedence``), takes room from (one scheduled before took its own already),
        each with the tokens the prompts after it of such precedence have left (what they may take at most)."""
        fewest: dict[int, int] = {}  # precedence -> fewest tokens left among the prompts after this one
        left_after: dict[int, int] = {}  # precedence -> tokens left of the prompts after this one
        yielding = {}
        for seq in reversed(prefills):
            rank, left = self._policy.precedence(seq), seq.num_uncomputed_tokens
            if any(tokens < left for r, tokens in fewest.items() if r <= rank):
                yielding[seq] = sum(tokens for r, tokens in left_after.items() if r <= rank)
            fewest[rank] = min(fewest.get(rank, left), left)
            left_after[rank] = left_after.get(rank, 0) + left
        return yielding

    def _prefill_share(self, seq: Sequence, draft: PlanDraft, yielding: dict[Sequence, int],
                       waiting: Sequence | None) -> tuple[float, int]:
        """The share of the step's prefill room that ``seq``'s next chunk may take with the chunks before
        it, and the most tokens it leaves to others (``PlanDraft.chunk_tokens``): all of it, unless a prompt
        of ``seq``'s precedence or an earlier one (``Policy.precedence``) has fewer tokens left: one being
        prefilled after it in this step (``yielding``) or ``waiting`` (the waiting sequence admission takes
        next, when it would be admitted on this worker after the running sequences,
        ``Scheduler._admissible_next``: a prompt counted whole, its cached prefix too; a fork, one token);
        then ``1 - short_prompt_share``, or more where they need less. Shortest remaining prefill first, as
        SRPT orders jobs, without starving the long prompt: a short request's first token is not queued behind
        every chunk of a long one."""
        left, rank = seq.num_uncomputed_tokens, self._policy.precedence(seq)
        need = 0 if waiting is None else 1 if waiting.fork_parent is not None else waiting.num_tokens
        waiting_shorter = (waiting is not None and not draft.preempted and need < left
                           and self._policy.precedence(waiting) <= rank)
        if seq not in yielding and not waiting_shorter:
            return 1.0, 0
        return 1.0 - self.config.short_prompt_share, yielding.get(seq, 0) + (need if waiting_shorter else 0)

    def _lookahead(self, worker: WorkerState, schedulable: list[Sequence], token_budget: int) -> int:
        """The step's most draft slots per decode: ``num_speculative_tokens`` (fixed), or what
        ``goodput.best_lookahead`` picks for the worker's decodes, counting every schedulable one (a
        speculating sequence with a token in flight waits for it only when the step drafts), at most
        what ``token_budget`` leaves once every decode and the slots of the seeded sampled ones fit
        (those draft whatever the step does, ``lookahead.sequence_lookahead``, and their slots must
        not depend on the others')."""
        k = self.speculative.num_lookahead_tokens
        if k == 0 or self.speculative.control is SpeculativeControl.FIXED:
            return k
        decodes = [s for s in schedulable if s.num_uncomputed_tokens == 1]
        speculating = [s.num_computed_tokens for s in decodes if s.num_output_tokens + s.num_tokens_in_flight > 0
                       and not repeats_draws(s)]
        if not speculating:
            return 0
        room = token_budget - len(decodes) - k * sum(repeats_draws(s) for s in decodes)
        return best_lookahead(worker.drafts, worker.step_cost.cost(), [s.num_computed_tokens for s in decodes],
                              speculating, min(k, max(0, room) // len(speculating)))

    def _make_room(self, worker: WorkerState, seq: Sequence, needed: int, queue: deque[Sequence],
                   draft: PlanDraft) -> bool:
        """Preempts for ``seq`` until ``needed`` of ``worker``'s blocks are free: the sequences still to
        be scheduled after it (``queue``), last first, then ``seq`` itself.

        Returns:
            False if ``seq`` is alone on the worker and still does not fit; else True: it fits, or it
            was preempted itself (its status says so).
        """
        while needed > worker.blocks.num_free_blocks:
            if not queue and len(worker.running) == 1:
                return False
            victim = queue.pop() if queue else seq
            self._preempt(worker, victim, draft)
            if victim is seq:
                break
        return True

    def _preempt(self, worker: WorkerState, seq: Sequence, draft: PlanDraft) -> None:
        """Takes a running sequence's blocks back: swap when asked and possible, else recompute."""
        self.num_preemptions += 1
        seq.num_preemptions += 1
        draft.preempted = True  # no admissions on this worker in this iteration
        if self.config.preemption_mode is PreemptionMode.SWAP and worker.blocks.can_swap_out(seq.seq_id):
            self.num_swap_preemptions += 1
            worker.swap_out(seq, draft)
            return
        self.requeue(seq)

    def requeue(self, seq: Sequence) -> None:
        """Recompute preemption (also of a lost worker's sequences): frees the blocks; the sequence
        waits ahead of later arrivals."""
        self._workers.release(seq)
        self._requests.requeue(seq)
