"""The scheduler's view of one worker, and the plan being drafted for it in an iteration."""

from __future__ import annotations

import math
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from pagedserve.engine.messages import BatchPlan, CachedRequestData, NewRequestData, SampledToken, SequenceId
from pagedserve.engine.block_manager import NO_PREFIX, BlockManager, CachedPrefix, blocks_for_tokens
from pagedserve.engine.prefix_caching import PrefixCachingBlockManager
from pagedserve.engine.config import PrefixCacheOutputs, SchedulerConfig, WorkerStats
from pagedserve.engine.sequence import Sequence, SequenceStatus
from pagedserve.engine.spec_decode.goodput import DraftStats
from pagedserve.engine.step_cost import StepCost, StepCostModel, StepShape, attention_pairs, prefill_chunk_tokens


@dataclass
class PlanDraft:
    """One worker's plan while the iteration is being scheduled.

    Attributes:
        token_budget: tokens still free in this iteration.
        cost: the worker's fitted step cost (``step_cost``; None before any step was seen: prefill
            chunks are capped by the token budget only), asked for only when a prefill chunk is
            sized beside decodes (a fit takes about a millisecond, and every answer changes it).
        max_decode_slowdown: ``SchedulerConfig.max_decode_slowdown``.
        preempted: a sequence was preempted here this iteration (no admissions then).
        swap_out, swap_in, copies: block copies for the worker, in the order it makes them.
        scheduled: tokens scheduled per sequence in this iteration.
        decode_tokens, decode_pairs: the query rows of the decodes scheduled so far (one each, plus
            its lookahead slots: a speculative decode verifies its drafts as more rows) and the
            attention pairs they compute.
        lookahead: the speculative decodes, as sequence -> (its context, lookahead slots).
        pairs: the attention pairs of everything scheduled so far.
        chunks: the prefill chunks scheduled so far, as (context, tokens).
        sampling: the sequences whose next token the step samples (its answer must carry them).
    """

    token_budget: int
    cost: Callable[[], StepCost | None] = lambda: None
    max_decode_slowdown: float = math.inf
    scheduled: dict[SequenceId, int] = field(default_factory=dict)
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    preempted: bool = False
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    decode_tokens: int = 0
    decode_pairs: int = 0
    lookahead: dict[SequenceId, tuple[int, int]] = field(default_factory=dict)
    pairs: int = 0
    chunks: list[tuple[int, int]] = field(default_factory=list)
    sampling: list[Sequence] = field(default_factory=list)

    def chunk_tokens(self, context: int, remaining: int, share: float = 1.0, reserve: int = 0) -> int:
        """Tokens to compute now for a sequence with ``remaining`` tokens after ``context`` computed
        ones: a decode (``remaining`` 1) while the token budget lasts; a prefill chunk as long as
        ``share`` of the step's prefill room allows, or all of it but what ``reserve`` tokens (those the
        prompts it leaves room to may take; priced at context 0) need when that is more, less the
        chunks scheduled before it: the room is the token budget the decodes leave and, when the step
        runs decodes, the time they leave (``prefill_chunk_tokens``, ``step_cost``). The step's first
        chunk gets at least one token whatever its share, so a prompt never starves behind decodes."""
        first, chunked = not self.chunks, sum(n for _, n in self.chunks)
        held = max(math.floor(share * (self.token_budget + chunked)) - chunked, self.token_budget - reserve)
        limit = max(0, min(remaining, self.token_budget, max(held, 1) if first else held))
        if remaining == 1 or limit == 0 or not self.decode_tokens or math.isinf(self.max_decode_slowdown):
            return limit
        cost = self.cost()
        if cost is None:
            return limit
        room_s = (self.max_decode_slowdown - 1) * cost.step_seconds(self.decode_tokens, self.decode_pairs,
                                                                    self.decode_tokens)
        allowance_s = max(share * room_s, room_s - cost.chunk_seconds(0, reserve)) - sum(
            cost.chunk_seconds(c, n) for c, n in self.chunks)
        tokens = prefill_chunk_tokens(cost, allowance_s, context, limit)
        return max(tokens, 1) if first else tokens

    def add(self, context: int, num_new: int, num_lookahead: int = 0) -> None:
        """Counts ``num_new`` tokens after ``context`` computed ones, and ``num_lookahead`` slots for
        drafts after them (the most query rows their verification adds), as scheduled in this step."""
        rows = num_new + num_lookahead
        self.token_budget -= rows
        pairs = attention_pairs(context, rows)
        self.pairs += pairs
        if num_new == 1:
            self.decode_tokens += rows
            self.decode_pairs += pairs
        else:
            self.chunks.append((context, num_new))

    def shape(self) -> StepShape:
        """What the drafted step computes (for the worker's cost model), every lookahead slot counted
        as a verified draft (``SentStep.computed`` corrects it from the answer)."""
        rows = sum(self.scheduled.values()) + sum(slots for _, slots in self.lookahead.values())
        return StepShape(rows, self.pairs, self.decode_tokens)


@dataclass(frozen=True)
class SentStep:
    """A plan sent to a worker and not answered yet.

    Attributes:
        shape: what it computes (for the cost model), every lookahead slot counted as a draft.
        made: when it was made, monotonic seconds.
        sampling: the sequences whose next token it samples.
        lookahead: ``PlanDraft.lookahead``'s speculative decodes, as (sequence, context, slots).
    """

    shape: StepShape
    made: float
    sampling: tuple[Sequence, ...]
    lookahead: tuple[tuple[SequenceId, int, int], ...] = ()

    def computed(self, sampled: Mapping[SequenceId, SampledToken]) -> StepShape:
        """What the step computed, given its answer's tokens per sequence (the drafts the worker
        verified: ``SampledToken.num_draft_tokens``): lookahead slots it left empty computed nothing."""
        empty, pairs = 0, self.shape.pairs
        for seq_id, context, slots in self.lookahead:
            drafts = self._drafts(sampled, seq_id, slots)
            empty += slots - drafts
            pairs -= attention_pairs(context, 1 + slots) - attention_pairs(context, 1 + drafts)
        return StepShape(self.shape.tokens - empty, pairs, self.shape.decode_rows - empty)

    def draft_outcomes(self, sampled: Mapping[SequenceId, SampledToken]) -> list[tuple[int, int, int]]:
        """Per speculative decode of the step: (slots reserved, drafts verified, drafts accepted)."""
        return [(slots, self._drafts(sampled, seq_id, slots), len(sampled[seq_id].accepted) if seq_id in sampled else 0)
                for seq_id, _, slots in self.lookahead]

    @staticmethod
    def _drafts(sampled: Mapping[SequenceId, SampledToken], seq_id: SequenceId, slots: int) -> int:
        return min(sampled[seq_id].num_draft_tokens, slots) if seq_id in sampled else 0


class WorkerState:
    """One worker: its block manager, the sequences running and swapped out on it.

    ``running`` keeps admission order. ``dropped_ids`` are sequences whose worker-side state must
    be dropped with the next plan (finished, aborted, preempted, swapped out). ``session_id`` is
    new for every admission of the worker: its plans carry it, and a worker that sees a new one
    drops everything it holds.
    """

    def __init__(self, worker_id: str, num_blocks: int, num_cpu_blocks: int, config: SchedulerConfig,
                 device: str) -> None:
        self.worker_id = worker_id
        self.config = config
        self.token_budget = config.token_budget(device)  # tokens one of its steps computes at most
        manager = PrefixCachingBlockManager if config.enable_prefix_caching else BlockManager
        self.blocks: BlockManager = manager(num_blocks, config.block_size, num_cpu_blocks)
        self.session_id = uuid.uuid4().hex
        self.running: OrderedDict[SequenceId, Sequence] = OrderedDict()
        self.swapped: OrderedDict[SequenceId, Sequence] = OrderedDict()
        self.dropped_ids: list[SequenceId] = []
        self.num_steps = 0
        self.step_cost = StepCostModel()
        self.drafts = DraftStats()  # how often its drafts were filled and accepted (``goodput``)
        self._sent: dict[int, SentStep] = {}  # by step id
        self._last_answer = 0.0  # monotonic seconds of the latest answer

    def new_draft(self) -> PlanDraft:
        """An empty plan for this iteration, with the worker's fitted step cost."""
        return PlanDraft(self.token_budget, self.step_cost.cost, self.config.max_decode_slowdown)

    def step_answered(self, step_id: int, sampled: tuple[SampledToken, ...]) -> tuple[Sequence, ...]:
        """Feeds the cost model the step's time: from when it was made, or from the previous
        answer if the worker was still busy with that one (plans queue up on a worker), to now;
        and what it computed (``sampled``: the answer's tokens; a speculative step's verified drafts
        are read from its own samples', not forked ones'); feeds :attr:`drafts` the step's draft
        outcomes.

        Returns:
            The sequences whose token the step sampled (none for a step unknown here).
        """
        now = time.monotonic()
        sent = self._sent.pop(step_id, None)
        if sent is not None:
            own = {s.seq_id: s for s in sampled if s.sample_index == s.seq_id.sample_index} if sent.lookahead else {}
            self.step_cost.observe(sent.computed(own), now - max(sent.made, self._last_answer))
            self.drafts.observe(sent.draft_outcomes(own))
        self._last_answer = now
        return sent.sampling if sent is not None else ()

    def release(self, seq_id: SequenceId) -> None:
        """Frees a sequence's blocks here (device or swapped) and tells the worker to drop it."""
        self.blocks.free(seq_id)
        if self.running.pop(seq_id, None) is not None:
            self.dropped_ids.append(seq_id)
        self.swapped.pop(seq_id, None)

    def start(self, seq: Sequence, draft: PlanDraft, num_new: int) -> None:
        """Makes ``seq`` (its blocks allocated here) run on this worker, sent in full: it is new to it."""
        seq.status, seq.worker_id = SequenceStatus.RUNNING, self.worker_id
        self.running[seq.seq_id] = seq
        draft.new_requests.append(NewRequestData(
            seq_id=seq.seq_id,
            token_ids=seq.all_token_ids(),
            num_prompt_tokens=seq.num_prompt_tokens,
            block_ids=self.blocks.block_table(seq.seq_id),
            num_computed_tokens=seq.num_computed_tokens,
            num_scheduled_tokens=num_new,
            sampling=seq.sampling.for_worker(),
            trace_context=seq.request.trace_context,
        ))
        self.advance(seq, num_new, draft)

    def advance(self, seq: Sequence, num_new: int, draft: PlanDraft, num_lookahead: int = 0) -> None:
        """Counts ``num_new`` tokens of ``seq`` as computed in this step (one more token is in
        flight when they reach its end), and ``num_lookahead`` slots reserved for its drafts
        against the token budget; caches blocks that filled up."""
        draft.add(seq.num_computed_tokens, num_new, num_lookahead)
        if num_lookahead:
            draft.lookahead[seq.seq_id] = (seq.num_computed_tokens, num_lookahead)
        seq.num_computed_tokens += num_new
        draft.scheduled[seq.seq_id] = num_new
        if seq.num_computed_tokens == seq.num_tokens + seq.num_tokens_in_flight:
            seq.sampling_scheduled(self.worker_id, self.num_steps + 1)  # the step ``take_plan`` makes next
            seq.num_lookahead_slots = num_lookahead
            draft.sampling.append(seq)
        self.cache_full_blocks(seq)

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Makes ``seq``'s blocks findable by prefix once their slots are computed (or scheduled)
        and their token ids known: a block that ends in a token still in flight waits for it. With
        ``--prefix-cache-outputs own``, blocks past its prompt are keyed by its prompt's length too
        (:meth:`prompt_end`): only the same sequence resumed or recomputed finds them."""
        num_tokens = min(seq.num_computed_tokens, seq.num_tokens)
        if self.blocks.fills_uncached_block(seq.seq_id, num_tokens):
            self.blocks.cache_full_blocks(seq.seq_id, seq.all_token_ids, num_tokens, seq.request.cache_salt.encode(),
                                          num_prompt_tokens=self.prompt_end(seq))

    def cached_prefix(self, seq: Sequence) -> CachedPrefix:
        """The longest cached start of ``seq``'s tokens here (none when prefix caching is off)."""
        if not self.config.enable_prefix_caching:
            return NO_PREFIX
        return self.blocks.find_cached_prefix(seq.all_token_ids(), seq.request.cache_salt.encode(),
                                              num_prompt_tokens=self.prompt_end(seq))

    def prompt_end(self, seq: Sequence) -> int | None:
        """Where ``seq``'s blocks are keyed as generated in the prefix cache (``block_hash.hash_full_blocks``):
        its prompt's end with ``--prefix-cache-outputs own``; None (every block keyed as a prompt's) with
        ``shared``."""
        return seq.num_prompt_tokens if self.config.prefix_cache_outputs is PrefixCacheOutputs.OWN else None

    def swap_in(self, draft: PlanDraft, max_num_seqs: int) -> None:
        """Brings swapped-out sequences back and starts them (oldest first) while blocks, budget
        (tokens and prefill time) and room allow."""
        blocks = self.blocks
        for seq in list(self.swapped.values()):
            if seq.num_tokens_in_flight or draft.preempted or draft.token_budget == 0 or len(self.running) >= max_num_seqs:
                return
            num_new = draft.chunk_tokens(seq.num_computed_tokens, seq.num_uncomputed_tokens)
            total = seq.num_computed_tokens + num_new
            needed = max(len(blocks.cpu_block_table(seq.seq_id)), blocks_for_tokens(total, blocks.block_size))
            if num_new == 0 or needed > blocks.num_free_blocks:
                return
            draft.swap_in.extend(blocks.swap_in(seq.seq_id))
            blocks.allocate_slots(seq.seq_id, total)
            del self.swapped[seq.seq_id]
            self.start(seq, draft, num_new)

    def swap_out(self, seq: Sequence, draft: PlanDraft) -> None:
        """Swap preemption: the sequence's blocks go to CPU memory; the worker drops its state and
        gets it in full again when the sequence is swapped back in."""
        draft.swap_out.extend(self.blocks.swap_out(seq.seq_id))
        del self.running[seq.seq_id]
        self.dropped_ids.append(seq.seq_id)
        self.swapped[seq.seq_id] = seq
        seq.status = SequenceStatus.SWAPPED

    def has_plan(self, draft: PlanDraft) -> bool:
        """Whether the worker has anything to do: work in ``draft``, or sequences to drop."""
        return bool(draft.new_requests or draft.cached_requests or draft.swap_out or draft.swap_in
                    or draft.copies or self.dropped_ids)

    def take_plan(self, draft: PlanDraft) -> BatchPlan:
        """The iteration's plan for this worker; clears the pending drops and counts the step."""
        self.num_steps += 1
        self._sent[self.num_steps] = SentStep(draft.shape(), time.monotonic(), tuple(draft.sampling),
                                              tuple((s, c, k) for s, (c, k) in draft.lookahead.items()))
        plan = BatchPlan(
            session_id=self.session_id,
            step_id=self.num_steps,
            new_requests=tuple(draft.new_requests),
            cached_requests=tuple(draft.cached_requests),
            finished_seq_ids=tuple(self.dropped_ids),
            blocks_to_swap_out=tuple(draft.swap_out),
            blocks_to_swap_in=tuple(draft.swap_in),
            blocks_to_copy=tuple(draft.copies),
        )
        self.dropped_ids.clear()
        return plan

    def stats(self) -> WorkerStats:
        return WorkerStats(
            worker_id=self.worker_id,
            num_blocks=self.blocks.num_blocks,
            num_free_blocks=self.blocks.num_free_blocks,
            num_running=len(self.running),
            num_swapped=len(self.swapped),
            num_cached_blocks=self.blocks.num_cached_blocks,
            token_budget=self.token_budget,
        )

