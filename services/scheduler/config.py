"""The scheduler's policy settings, and the stats it reports."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one iteration on one worker.

    Attributes:
        block_size: token slots per KV-cache block; every worker must use the same.
        max_num_seqs: most sequences running on one worker at once.
        max_num_batched_tokens: most tokens (prefill chunks + decodes) one worker computes in one
            iteration. Prompts longer than this are prefilled in chunks over several iterations.

    Raises:
        ValueError: a non-positive limit, or a token budget smaller than ``max_num_seqs`` (every
            running sequence must be able to decode in the same iteration).
    """

    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                f"max_num_seqs ({self.max_num_seqs})"
            )


@dataclass(frozen=True)
class WorkerStats:
    """KV-cache occupancy of one worker, in blocks."""

    worker_id: str
    num_blocks: int
    num_free_blocks: int
    num_running: int


@dataclass(frozen=True)
class SchedulerStats:
    """A snapshot of the scheduler's queues."""

    num_waiting: int
    num_running: int
    num_preemptions: int
    num_steps: int
    workers: tuple[WorkerStats, ...]
