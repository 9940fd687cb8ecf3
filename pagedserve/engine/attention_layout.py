"""How a step's rows are laid out for attention, so that a position's bits never depend on how it is
computed again.

A row at a generated position (a decode, a draft's verification row, an output token recomputed
after a recompute preemption, a worker's loss or a migration) goes to the decode op as a one-token
sequence, the way plain decoding computed it; a sequence's prompt rows go to the prefill op as one
sequence, whose sums over key blocks do not depend on how the prompt is chunked or cached. With the
batch-invariant panel GEMMs the two ops were the only difference: an output recomputed through the
prefill op moved the logprobs that follow by up to ~1.5e-5 (a seeded draw at a boundary, or greedy at
a near-tie, could then change; docs/benchmarks.md "Recompute through the decode op"), and a prompt's
one-token remainder after a prefix-cache hit took the decode op where the whole prompt took the prefill op.

The decode rows come first (``num_decode_seqs``, the leading sequences the CPU backends read as decodes;
the Triton backend sends a batch with any longer sequence through its prefill kernel, one-token
sequences included); the model's hidden rows are put back in the batch's order afterwards when a
sequence's rows were split (:attr:`AttentionLayout.batch_rows`). A step with a prompt's one-token
remainder runs the Python layers, not the C++ decode-layer loop (it takes steps of decodes only).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pagedserve.engine.worker_requests import ScheduledRequest


@dataclass
class _Part:
    token_ids: list[int] = field(default_factory=list)
    query_lens: list[int] = field(default_factory=list)
    context_lens: list[int] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)
    batch_rows: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class AttentionLayout:
    """A step's flat token batch in attention order.

    Attributes:
        token_ids: the new tokens, decode rows first, then each sequence's prompt rows.
        query_lens, context_lens, block_tables: per metadata sequence, as ``ForwardBatch.build`` takes them.
        num_decode_seqs: the leading one-token sequences that attend as decodes.
        batch_rows: per flat row, its row in the batch's order (each request's rows together, in order).
        in_batch_order: whether ``batch_rows`` is ``0, 1, ..., T - 1`` (a step without recomputed outputs
            or prompt remainders among its decodes): the hidden rows need no reordering.
    """

    token_ids: list[int]
    query_lens: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    num_decode_seqs: int
    batch_rows: list[int]
    in_batch_order: bool


def attention_layout(batch: Sequence[ScheduledRequest]) -> AttentionLayout:
    """Splits each request's rows at its prompt's end: the prompt rows as one sequence for the prefill op,
    every later row (and each draft) as a one-token sequence over the positions before it."""
    decodes, prompts, row = _Part(), _Part(), 0
    for s in batch:
        state, start = s.state, s.state.num_computed_tokens
        tokens = state.token_ids[start:start + s.num_scheduled_tokens] + list(s.draft_token_ids)
        num_prompt = min(max(state.num_prompt_tokens - start, 0), s.num_scheduled_tokens)  # drafts: never prompt
        if num_prompt:
            prompts.token_ids += tokens[:num_prompt]
            prompts.query_lens.append(num_prompt)
            prompts.context_lens.append(start)
            prompts.block_tables.append(state.block_ids)
            prompts.batch_rows += range(row, row + num_prompt)
        first, rest = start + num_prompt, len(tokens) - num_prompt
        decodes.token_ids += tokens[num_prompt:]
        decodes.query_lens += [1] * rest
        decodes.context_lens += range(first, first + rest)
        decodes.block_tables += [state.block_ids] * rest
        decodes.batch_rows += range(row + num_prompt, row + len(tokens))
        row += len(tokens)
    # each part's rows rise, and together they are 0..T-1: in order when every decode row comes first
    in_order = not (decodes.batch_rows and prompts.batch_rows) or decodes.batch_rows[-1] < prompts.batch_rows[0]
    return AttentionLayout(decodes.token_ids + prompts.token_ids, decodes.query_lens + prompts.query_lens,
                           decodes.context_lens + prompts.context_lens, decodes.block_tables + prompts.block_tables,
                           len(decodes.query_lens), decodes.batch_rows + prompts.batch_rows, in_order)
