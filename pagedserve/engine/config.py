"""The scheduler's per-iteration limits and modes, and the stats it reports."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one iteration on one worker.

    Attributes:
        block_size: token slots per KV-cache block; every worker must use the same.
        max_num_seqs: most sequences running on one worker at once.
        max_num_batched_tokens: most tokens (decodes + prefill chunks) one worker computes in one
            iteration. Decodes are served first; prefill chunks fill the rest.
        enable_chunked_prefill: prefill prompts longer than what is left of the budget over several
            iterations; without it a prompt is prefilled whole or waits (and one longer than the
            budget is refused).
        enable_prefix_caching: share cached full blocks between requests with the same prefix.
        preemption_mode: ``recompute`` (free the blocks, prefill again later) or ``swap`` (copy
            them to the worker's CPU blocks and back; recompute when CPU blocks run out).
        policy: ``fcfs`` or ``priority`` (see pagedserve/engine/policy.py).

    Raises:
        ValueError: a non-positive limit, an unknown mode or policy.
    """

    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    preemption_mode: str = "recompute"
    policy: str = "fcfs"

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be recompute or swap, got {self.preemption_mode!r}")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be fcfs or priority, got {self.policy!r}")


@dataclass(frozen=True)
class WorkerStats:
    """KV-cache occupancy of one worker, in blocks."""

    worker_id: str
    num_blocks: int
    num_free_blocks: int
    num_running: int
    num_swapped: int = 0
    num_cached_blocks: int = 0


@dataclass(frozen=True)
class SchedulerStats:
    """A snapshot of the scheduler's queues."""

    num_waiting: int
    num_running: int
    num_preemptions: int
    num_steps: int
    workers: tuple[WorkerStats, ...]
    num_swapped: int = 0
    num_swap_preemptions: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up
    prefix_cache_hits: int = 0  # of which found cached
