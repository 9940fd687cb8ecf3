"""The scheduler's side of speculative decoding: KV slots reserved for a decode's drafts, and what an
answer with accepted drafts changes.

The worker proposes (it holds the sequence's tokens, and the draft model lives beside the
target); the scheduler only reserves ``k`` lookahead slots past a decode's token
(``CachedRequestData.num_lookahead_tokens``) and, when the answer comes, counts the accepted drafts
as computed and frees the slots past them (``BlockManager.truncate``). The worker truncates its
block table by the same rule (``kept_blocks``), so both keep ``blocks_for_tokens(computed)`` blocks.

Which sequences speculate: decodes (one scheduled token) that have an output already, no token in
flight, and room for one more token after the bonus one (``max_tokens``). Every sampling parameter
sees the drafts in order: the worker verifies each draft position with the history and output count it
would have without speculation (penalties, bad words, ``min_tokens``, ``logit_bias``) and a structured
output's mask after the drafts before it (``grammar_matchers.draft_masks``), the
scheduler appends the emitted tokens one by one and stops at the first that ends the sequence
(EOS, stop ids, ``max_tokens``, a grammar failure), and the text side looks for stop strings token by
token. A lookahead that does not fit in the free blocks or the token budget is dropped, never preempting.

A sequence does not run ahead of the answer of a step that verified drafts (overlap scheduling,
``Sequence.can_run_ahead``): how many tokens that step yields is known from its answer only; nor,
to draft, of any answer when its next step would draft (a step scheduled before the last token is
known could not draft). How many slots a step gives: ``goodput``.
"""

from __future__ import annotations

from pagedserve.engine.block_manager import BlockManager, blocks_for_tokens
from pagedserve.engine.sequence import Sequence


def repeats_draws(seq: Sequence) -> bool:
    """Whether ``seq`` is a seeded sampled sequence: which draw decides its token follows where drafts
    were verified, so its tokens repeat only if that does not follow the batch's step times."""
    return seq.sampling.seed is not None and not seq.sampling.is_greedy


def sequence_lookahead(seq: Sequence, step_lookahead: int, num_speculative_tokens: int) -> int:
    """The most draft slots ``seq`` gets in a step whose decodes get ``step_lookahead``: every one of
    ``num_speculative_tokens`` for a seeded sampled sequence (:func:`repeats_draws`; as with
    ``--speculative-control fixed``), else ``step_lookahead``."""
    return num_speculative_tokens if num_speculative_tokens and repeats_draws(seq) else step_lookahead


def waits_for_answer(seq: Sequence, num_lookahead: int) -> bool:
    """Whether ``seq``'s next step waits until its tokens in flight are known: always after a step that
    reserved draft slots (how many tokens it yields is in its answer only), and to speculate in a step
    whose decodes get ``num_lookahead`` > 0 slots."""
    if seq.num_tokens_in_flight == 0:
        return False
    return seq.num_lookahead_slots > 0 or num_lookahead > 0


def lookahead_slots(seq: Sequence, num_new: int, num_speculative_tokens: int, blocks: BlockManager,
                    token_budget: int) -> int:
    """KV slots to reserve past ``seq``'s ``num_new`` scheduled tokens for drafts (see the module
    docstring for who speculates), at most ``num_speculative_tokens``; 0 when they do not fit in the
    free blocks or in ``token_budget`` (tokens left in the step after the scheduled ones)."""
    if num_new != 1 or num_speculative_tokens == 0 or seq.num_output_tokens == 0 or seq.num_tokens_in_flight:
        return 0
    wanted = min(num_speculative_tokens, seq.sampling.max_tokens - seq.num_output_tokens - 1, token_budget - num_new)
    if wanted <= 0:
        return 0
    total = seq.num_computed_tokens + num_new + wanted
    return wanted if blocks.num_new_blocks(seq.seq_id, total) <= blocks.num_free_blocks else 0


def kept_blocks(num_computed_tokens: int, block_size: int) -> int:
    """Blocks a sequence keeps after a speculative step: those holding its computed slots."""
    return blocks_for_tokens(num_computed_tokens, block_size)


def settle_drafts(seq: Sequence, num_accepted: int, blocks: BlockManager) -> None:
    """After the answer of ``seq``'s speculative step (the sequence still running): its accepted
    drafts' K/V are computed; the slots reserved past them go back to the free list."""
    seq.num_computed_tokens += num_accepted
    seq.num_lookahead_slots = 0
    blocks.truncate(seq.seq_id, seq.num_computed_tokens)  # keeps kept_blocks(computed) blocks
