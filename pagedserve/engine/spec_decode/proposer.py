"""What the worker's ModelRunner asks of a proposer (the n-gram one and the draft model's): drafts for
a step's speculating sequences, and a look at every forward batch and block move of the target."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from pagedserve.engine.forward_batch import ForwardBatch
from pagedserve.engine.messages import BatchPlan
from pagedserve.engine.worker_requests import ScheduledRequest


class Proposer(Protocol):
    """Drafts tokens for speculative decoding on one worker."""

    def propose(self, requests: Sequence[ScheduledRequest]) -> list[tuple[int, ...]]:
        """Per request (in order), its drafts: at most ``num_lookahead_tokens`` of them, possibly none.
        Each request schedules one token, its last known one, not yet in any cache (a decode: the
        scheduler reserves lookahead slots for those only), and its block table covers the lookahead."""
        ...

    def observe(self, batch: ForwardBatch) -> None:
        """Sees the target's forward batch of a step (prefill chunks, decodes, verification rows), after
        the target ran it."""
        ...

    def move_blocks(self, plan: BatchPlan) -> None:
        """Applies the plan's block swaps and copies, as the target's cache does (before the step)."""
        ...
