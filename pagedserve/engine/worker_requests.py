"""What a worker holds per sequence between steps, and what one step computes of each (the pieces
of ``model_runner`` that read a plan: its checks, the batch order, the rows to sample)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedserve.engine.logprobs import PromptChunk
from pagedserve.engine.messages import SequenceId
from pagedserve.engine.sampling_params import EngineSamplingParams, child_sampling


class PlanMismatchError(ValueError):
    """A BatchPlan contradicts the worker's state (unknown request, token counts that disagree, too few blocks)."""


@dataclass
class RequestState:
    """What the worker holds for one sequence between steps (mutable; owned by the ModelRunner).

    Attributes:
        seq_id: the sequence (a sample of a request).
        token_ids: prompt followed by every token sampled so far.
        num_prompt_tokens: length of the prompt.
        block_ids: the block table, logical -> physical block id.
        num_computed_tokens: tokens whose K/V are in the cache.
        sampling: the request's sampling parameters.
        matcher: its grammar matcher when it has a structured output (on the rank that samples),
            advanced with each token sampled; rebuilt by replaying the output tokens whenever the
            sequence arrives in full (``GrammarCompiler.matcher``).
    """

    seq_id: SequenceId
    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    sampling: EngineSamplingParams
    matcher: object | None = None

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass(frozen=True)
class ScheduledRequest:
    """A request, how many of its tokens this step computes, the KV slots reserved past them for
    drafts, and the drafts it verifies (speculative decoding: each one more query row) with the
    distributions they were drawn from (float32 ``[len(draft_token_ids), V]``; ``None``: chosen
    drafts, ``spec_decode.proposer.Proposal``)."""

    state: RequestState
    num_scheduled_tokens: int
    num_lookahead_tokens: int = 0
    draft_token_ids: tuple[int, ...] = ()
    draft_probs: torch.Tensor | None = None

    @property
    def num_query_tokens(self) -> int:
        """Rows this step computes for the request: its scheduled tokens and its drafts."""
        return self.num_scheduled_tokens + len(self.draft_token_ids)

    @property
    def reaches_end(self) -> bool:
        """Whether this step computes the last known token, so a new token is sampled."""
        return self.state.num_computed_tokens + self.num_scheduled_tokens == len(self.state.token_ids)


def check_schedulable(state: RequestState, num_scheduled: int, num_blocks: int, block_size: int,
                       num_lookahead: int = 0) -> None:
    """Raises :class:`PlanMismatchError` if the known tokens or ``num_blocks`` cannot cover the
    scheduled work (and its lookahead slots)."""
    end = state.num_computed_tokens + num_scheduled + num_lookahead
    if num_scheduled < 0 or num_lookahead < 0 or end - num_lookahead > len(state.token_ids):
        raise PlanMismatchError(
            f"sequence {state.seq_id}: {state.num_computed_tokens} computed + {num_scheduled} scheduled "
            f"tokens exceeds the {len(state.token_ids)} tokens the worker knows")
    if num_blocks * block_size < end:
        raise PlanMismatchError(
            f"sequence {state.seq_id}: {num_blocks} blocks of {block_size} cannot hold {end} tokens")


def batch_order(s: ScheduledRequest) -> tuple[bool, int]:
    """The order a step runs its sequences in (also a pipeline stage's): decodes (with their drafts'
    rows, which attend as decodes) first, longest context first (so decode chunks pad little);
    prefills keep plan order, a prompt's one-token remainder among them (``attention_layout``)."""
    is_decode = s.num_scheduled_tokens == 1 and s.state.num_computed_tokens >= s.state.num_prompt_tokens
    return (not is_decode, -s.state.num_computed_tokens if is_decode else 0)


def prompt_chunk(s: ScheduledRequest, first_row: int) -> PromptChunk | None:
    """The prompt positions this step computes for a sequence that asks for ``prompt_logprobs``
    and has no output yet (after a recompute, its prompt logprobs were reported already)."""
    state = s.state
    k = state.sampling.prompt_logprobs
    if k is None or state.num_output_tokens > 0:
        return None
    start = state.num_computed_tokens
    end = min(start + s.num_scheduled_tokens, state.num_prompt_tokens - 1)
    return PromptChunk(state.seq_id, state.token_ids, first_row, start, end, k) if end > start else None


def expand_samples(ends: Sequence[ScheduledRequest]) -> tuple[list[int], list[EngineSamplingParams], list[int],
                                                                 list[tuple[ScheduledRequest, int]]]:
    """Logits rows to sample from: one per sequence, or ``n`` for a prompt with ``n > 1`` samples
    (sample ``i`` with its own derived seed, see ``child_sampling``); each with the sample index
    its token belongs to."""
    rows, params, counts, samples = [], [], [], []
    for row, s in enumerate(ends):
        first_of_many = s.state.num_output_tokens == 0 and s.state.sampling.n > 1
        for index in range(s.state.sampling.n if first_of_many else 1):
            rows.append(row)
            params.append(child_sampling(s.state.sampling, index) if first_of_many else s.state.sampling)
            counts.append(s.state.num_output_tokens)
            samples.append((s, index if first_of_many else s.state.seq_id.sample_index))
    return rows, params, counts, samples
