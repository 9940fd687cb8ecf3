"""The scheduler's view of one worker, and the plan being drafted for it in an iteration."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from services.common.messages import BatchPlan, CachedRequestData, NewRequestData
from services.scheduler.block_manager import BlockManager, PrefixCachingBlockManager
from services.scheduler.config import SchedulerConfig, WorkerStats
from services.scheduler.sequence import Sequence


@dataclass
class PlanDraft:
    """One worker's plan while the iteration is being scheduled.

    Attributes:
        token_budget: tokens still free in this iteration.
        preempted: a sequence was preempted here this iteration (no admissions then).
        swap_out, swap_in, copies: block copies for the worker, in the order it makes them.
        scheduled: tokens scheduled per sequence in this iteration.
    """

    token_budget: int
    scheduled: dict[str, int] = field(default_factory=dict)
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    preempted: bool = False
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)


class WorkerState:
    """One worker: its block manager, the sequences running and swapped out on it.

    ``running`` keeps admission order. ``dropped_ids`` are requests whose worker-side state must
    be dropped with the next plan (finished, aborted, preempted, swapped out).
    """

    def __init__(self, worker_id: str, num_blocks: int, num_cpu_blocks: int, config: SchedulerConfig) -> None:
        self.worker_id = worker_id
        manager = PrefixCachingBlockManager if config.enable_prefix_caching else BlockManager
        self.blocks: BlockManager = manager(num_blocks, config.block_size, num_cpu_blocks)
        self.running: OrderedDict[str, Sequence] = OrderedDict()
        self.swapped: OrderedDict[str, Sequence] = OrderedDict()
        self.dropped_ids: list[str] = []

    def release(self, request_id: str) -> None:
        """Frees a sequence's blocks here (device or swapped) and tells the worker to drop it."""
        self.blocks.free(request_id)
        if self.running.pop(request_id, None) is not None:
            self.dropped_ids.append(request_id)
        self.swapped.pop(request_id, None)

    def take_plan(self, step_id: int, draft: PlanDraft, scheduler_id: str) -> BatchPlan:
        """The iteration's plan for this worker; clears the pending drops."""
        plan = BatchPlan(
            scheduler_id=scheduler_id,
            step_id=step_id,
            new_requests=tuple(draft.new_requests),
            cached_requests=tuple(draft.cached_requests),
            finished_request_ids=tuple(self.dropped_ids),
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
            num_cached_blocks=getattr(self.blocks, "num_cached_blocks", 0),
        )
