"""The workers one scheduler plans for: registration, where a waiting sequence is admitted
(placement), whether any of them could ever run it, and their statistics."""

from __future__ import annotations

from collections.abc import Collection, Iterable

from pagedserve.engine.config import Placement, SchedulerConfig, SchedulerStats
from pagedserve.engine.limits import fits_worker, rejection_error
from pagedserve.engine.messages import BatchPlan, RequestError, SequenceId, StepResult
from pagedserve.engine.spec_decode.counters import SpecDecodeCounters
from pagedserve.engine.sequence import Sequence, SequenceStatus
from pagedserve.engine.worker_state import PlanDraft, WorkerState


class WorkerPool:
    """The registered workers (a ``WorkerState`` each, by id, in registration order)."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self._workers: dict[str, WorkerState] = {}

    def add(self, worker_id: str, num_blocks: int, num_cpu_blocks: int, device: str) -> None:
        """Registers a worker with ``num_blocks`` KV blocks (and CPU blocks for swapping) on ``device`` (its
        token budget's default, ``SchedulerConfig.token_budget``).

        Raises:
            ValueError: the id is already registered.
        """
        if worker_id in self._workers:
            raise ValueError(f"worker {worker_id!r} is already registered")
        self._workers[worker_id] = WorkerState(worker_id, num_blocks, num_cpu_blocks, self.config, device)

    def remove(self, worker_id: str) -> list[Sequence]:
        """Forgets a worker (nothing if unknown).

        Returns:
            The sequences that ran or were swapped out on it, latest admitted first (pushed back
            to the front of the queue in this order, the earliest ends up first).
        """
        worker = self._workers.pop(worker_id, None)
        return list(reversed([*worker.running.values(), *worker.swapped.values()])) if worker else []

    def __getitem__(self, worker_id: str) -> WorkerState:
        """The worker with this id. Raises KeyError if none."""
        return self._workers[worker_id]

    @property
    def ids(self) -> list[str]:
        return list(self._workers)

    def session_id(self, worker_id: str) -> str | None:
        """The session the worker's plans carry now (new at every ``add``); None if unknown."""
        worker = self._workers.get(worker_id)
        return worker.session_id if worker else None

    def sequences_on(self, worker_id: str) -> list[SequenceId]:
        """The sequences running on a worker. Raises KeyError if it is unknown."""
        return list(self._workers[worker_id].running)

    def release(self, seq: Sequence) -> None:
        """Frees ``seq``'s blocks on its worker (if it has one still registered)."""
        worker = self._workers.get(seq.worker_id) if seq.worker_id else None
        if worker is not None:
            worker.release(seq.seq_id)

    def has_drops(self) -> bool:
        """Whether a worker is still to be told to drop finished sequences' state."""
        return any(w.dropped_ids for w in self._workers.values())

    def new_drafts(self, worker_ids: Collection[str]) -> dict[str, PlanDraft]:
        """An empty plan for each of ``worker_ids`` that is registered (unknown ids are ignored)."""
        return {w: self._workers[w].new_draft() for w in worker_ids if w in self._workers}

    def take_plans(self, drafts: dict[str, PlanDraft]) -> dict[str, BatchPlan]:
        """The plans of the workers in ``drafts`` that have anything to do (``WorkerState.has_plan``)."""
        workers = [self._workers[w] for w in drafts]
        return {w.worker_id: w.take_plan(drafts[w.worker_id]) for w in workers if w.has_plan(drafts[w.worker_id])}

    def step_answered(self, worker_id: str, result: StepResult) -> tuple[Sequence, ...]:
        """``WorkerState.step_answered``: the sequences whose token the step sampled (none if the
        worker is unknown)."""
        worker = self._workers.get(worker_id)
        if worker is None:
            return ()
        return worker.step_answered(result.step_id, result.sampled)

    def place(self, seq: Sequence, drafts: dict[str, PlanDraft]) -> WorkerState | None:
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

    def rejection_error(self, seq: Sequence) -> RequestError | None:
        """``limits.rejection_error`` against every registered worker's size: the error of a
        sequence none of them could ever run, or None."""
        workers = [(w.blocks.num_blocks, w.token_budget) for w in self._workers.values()]
        return rejection_error(seq, workers, self.config)

    def cached_digests(self) -> frozenset[bytes]:
        """Content hashes of the prompt blocks cached on any worker (what peers route by)."""
        return frozenset(d for worker in self._workers.values() for d in worker.blocks.cached_digests())

    def stats(self, num_waiting: int, num_steps: int, num_preemptions: int, num_swap_preemptions: int,
              spec_decode: SpecDecodeCounters | None) -> SchedulerStats:
        """A snapshot of the queues and speculative-decoding counts (counted by the caller) and of
        every worker's KV occupancy and prefix-cache counters."""
        states = list(self._workers.values())
        per_worker = tuple(w.stats() for w in states)
        return SchedulerStats(
            num_waiting=num_waiting,
            num_running=sum(w.num_running for w in per_worker),
            num_preemptions=num_preemptions,
            num_steps=num_steps,
            workers=per_worker,
            num_swapped=sum(w.num_swapped for w in per_worker),
            num_swap_preemptions=num_swap_preemptions,
            prefix_cache_queries=sum(w.blocks.num_queried_tokens for w in states),
            prefix_cache_hits=sum(w.blocks.num_hit_tokens for w in states),
            spec_decode=spec_decode,
        )


def placement_score(worker: WorkerState, seq: Sequence, max_num_seqs: int) -> float:
    """How well ``seq`` fits on ``worker``: ``2 * overlap - kv_usage - load``, each in [0, 1].

    ``overlap`` is the fraction of its tokens whose blocks are cached there (computed once, not
    again), ``kv_usage`` the fraction of blocks held by sequences, ``load`` the running sequences
    over ``max_num_seqs``. The weights are those of NVIDIA Dynamo's KV-aware router (a cached
    prefix counts twice the load it adds to); higher is better.
    """
    blocks = worker.blocks
    cached = blocks.cached_prefix_length(seq.all_token_ids(), seq.request.cache_salt.encode(),
                                         num_prompt_tokens=worker.prompt_end(seq))
    overlap = cached / max(1, seq.num_tokens)
    kv_usage = 1 - blocks.num_free_blocks / max(1, blocks.num_blocks)
    return 2 * overlap - kv_usage - len(worker.running) / max_num_seqs


def pick_worker(workers: Iterable[WorkerState], drafts: dict[str, PlanDraft], config: SchedulerConfig,
                seq: Sequence) -> WorkerState | None:
    """Where to admit ``seq``: ``LEAST_LOADED``, the worker with the most free blocks among those
    being scheduled now (in ``drafts``) that can take another sequence (none that preempted in
    this iteration, has no budget left, runs ``max_num_seqs``, or is too small ever to hold
    ``seq``); ``PREFIX``, the best :func:`placement_score` among all ``workers`` that are eligible
    or busy with a step (not in ``drafts``): a busy one is returned too, and the caller waits for
    it. Ties go to the most free blocks."""
    def eligible(w: WorkerState) -> bool:  # (a worker too small for it could win on prefix and never take it)
        draft = drafts.get(w.worker_id)
        fits = fits_worker(seq.num_tokens, w.blocks.num_blocks, w.token_budget, config)
        return fits and len(w.running) < config.max_num_seqs and (
            draft is None or (not draft.preempted and draft.token_budget > 0))

    if config.placement is Placement.LEAST_LOADED:
        now = [w for w in workers if w.worker_id in drafts and eligible(w)]
        return max(now, key=lambda w: w.blocks.num_free_blocks, default=None)
    candidates = [w for w in workers if eligible(w)]
    if len(candidates) < 2:
        return next((w for w in candidates if w.worker_id in drafts), None)
    return max(candidates, key=lambda w: (placement_score(w, seq, config.max_num_seqs), w.blocks.num_free_blocks))
