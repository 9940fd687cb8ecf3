"""What the worker's ModelRunner asks of a proposer (the n-gram one and the draft model's): drafts for
a step's speculating sequences, and a look at every forward batch and block move of the target."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # annotations only: the n-gram proposer (which the scheduler's config names) runs without torch
    import torch

    from pagedserve.engine.forward_batch import ForwardBatch
    from pagedserve.engine.messages import BatchPlan
    from pagedserve.engine.sampler import Sampler
    from pagedserve.engine.worker_requests import ScheduledRequest


@dataclass(frozen=True)
class Proposal:
    """One sequence's drafts for a step.

    Attributes:
        token_ids: the drafts, in order (possibly none).
        probs: float32 ``[len(token_ids), V]``, the distributions the drafts were drawn from
            (``q`` of the rejection sampler), or ``None`` when each draft was chosen, not drawn
            (looked up, or a draft model's argmax): the sampler then treats ``q`` as one-hot.
    """

    token_ids: tuple[int, ...]
    probs: torch.Tensor | None = None


class Proposer(Protocol):
    """Drafts tokens for speculative decoding on one worker."""

    def propose(self, requests: Sequence[ScheduledRequest], sampler: Sampler) -> list[Proposal]:
        """Per request (in order), its drafts: at most ``num_lookahead_tokens`` of them, possibly none.
        Each request schedules one token, its last known one, not yet in any cache (a decode: the
        scheduler reserves lookahead slots for those only), and its block table covers the lookahead.
        A proposer that draws drafts takes its uniforms from ``sampler`` (``Sampler.uniforms``' third
        draw of the output index a draft stands at: apart from the verification's two)."""
        ...

    def observe(self, batch: ForwardBatch) -> None:
        """Sees the target's forward batch of a step (prefill chunks, decodes, verification rows), after
        the target ran it."""
        ...

    def move_blocks(self, plan: BatchPlan) -> None:
        """Applies the plan's block swaps and copies, as the target's cache does (before the step)."""
        ...
