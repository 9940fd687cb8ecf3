"""Admission headroom: room kept for the running sequences' growth when new requests are admitted.

Under recompute preemption (vLLM, Kwon et al. 2023, §4.5), admitting every waiting request whose prompt
fits now fills the cache with prompts that then grow into each other: the newest running sequences are
preempted and prefilled again later, work thrown away. 256 ShareGPT requests with 2 GiB of float32 K/V
(46,592 slots), replayed through the block manager (`pagedserve bench kv`): 131 preemptions, 34,829 tokens
computed again, 31% on top of the 112,410 tokens the requests need; on a CPU, where a step's cost grows
with its rows from ~64 rows on, that is time lost, while the larger batch saves next to nothing.

So a waiting sequence is admitted only if the worker's free blocks, after its own, still hold
``ratio x`` the tokens that each running sequence and it may yet generate (``max_tokens`` left, at most
:data:`GROWTH_CLIP`). The ratio is SGLang's "new token ratio" (Zheng et al. 2024, its scheduler's
``new_token_ratio``): it starts at ``headroom``, falls linearly to ``headroom x`` :data:`FLOOR_FRACTION`
over :data:`DECAY_STEPS` iterations without a preemption (requests end sooner than their ``max_tokens``
mostly), and goes back to ``headroom`` at a preemption. A worker running nothing admits what fits now,
so the headroom never keeps a request waiting for ever. ``headroom`` 0 admits whatever fits now (vLLM).
"""

from __future__ import annotations

from collections.abc import Iterable

from pagedserve.engine.block_manager import BlockManager, CachedPrefix
from pagedserve.engine.sequence import Sequence

GROWTH_CLIP = 4096
"""Most tokens of a sequence's remaining ``max_tokens`` that count towards the headroom (SGLang's clip)."""
DECAY_STEPS = 600
"""Iterations without a preemption over which the ratio falls from ``headroom`` to its floor (SGLang's)."""
FLOOR_FRACTION = 1 / 7
"""The ratio's floor as a fraction of ``headroom`` (SGLang's defaults: 0.7 falling to 0.1)."""


class AdmissionHeadroom:
    """The current ratio, and the admission test it gives.

    Args:
        headroom: the ratio after a preemption (and at start), ``0 <= headroom <= 1``.
    """

    def __init__(self, headroom: float) -> None:
        self.headroom = headroom
        self.ratio = headroom

    def end_iteration(self, num_preemptions: int) -> None:
        """Moves the ratio after an iteration that preempted ``num_preemptions`` sequences."""
        if num_preemptions:
            self.ratio = self.headroom
        else:
            decay = self.headroom * (1 - FLOOR_FRACTION) / DECAY_STEPS
            self.ratio = max(self.headroom * FLOOR_FRACTION, self.ratio - decay)

    def target_tokens(self, seq: Sequence) -> int:
        """Slots ``seq`` is expected to hold: its tokens, and the ratio of those it may yet generate."""
        remaining = min(seq.sampling.max_tokens - seq.num_output_tokens, GROWTH_CLIP)
        return seq.num_tokens + int(self.ratio * max(remaining, 0))

    def kept_blocks(self, blocks: BlockManager, running: Iterable[Sequence]) -> int:
        """Free blocks to keep for the growth of ``running`` (sequences with tables in ``blocks``)."""
        return sum(blocks.num_new_blocks(s.seq_id, self.target_tokens(s)) for s in running)

    def admits(self, blocks: BlockManager, seq: Sequence, num_tokens: int, prefix: CachedPrefix, kept: int,
               running: int) -> bool:
        """Whether ``seq`` may take ``num_tokens`` slots (after ``prefix``) now and leave ``kept`` blocks
        (:meth:`kept_blocks` of the ``running`` sequences) plus its own growth free; always when it fits
        and ``running`` is 0."""
        if not blocks.can_allocate(seq.seq_id, num_tokens, prefix):
            return False
        if running == 0:
            return True
        target = max(num_tokens, self.target_tokens(seq))
        return blocks.num_new_blocks(seq.seq_id, target, prefix) + kept <= blocks.num_free_blocks - prefix.num_free
