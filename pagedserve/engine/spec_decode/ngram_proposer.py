"""Drafting tokens by looking them up in the sequence itself: the n-gram (prompt lookup) proposer.

Saxena, "Prompt Lookup Decoding" (2023), as vLLM's ``ngram`` speculative method: when the last
``n`` tokens of a sequence (its prompt and output so far) occurred earlier in it, the tokens that
followed that earlier occurrence are proposed as the next ones. Workloads that copy from their
input (summarising, editing, answering from a document, code changes) repeat long runs, and each
accepted draft is a token decoded without a step of its own. The longest ``n`` in
``[min_n, max_n]`` that matches wins; among its matches, the latest one (the nearest context).

A structured output's drafts start with the tokens its grammar forces next
(``grammar_matchers.forced_tokens``: a JSON schema's keys, quotes and colons), which verification under
the grammar's mask accepts whenever the model's choice is their tokenization, and go on with the lookup
over the sequence followed by them: SGLang's jump-forward decoding, done through the verification step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedserve.engine.spec_decode.proposer import Proposal

if TYPE_CHECKING:  # annotations only: the scheduler reads SpeculativeConfig, which names this class, without torch
    from pagedserve.engine.forward_batch import ForwardBatch
    from pagedserve.engine.messages import BatchPlan
    from pagedserve.engine.sampler import Sampler
    from pagedserve.engine.worker_requests import ScheduledRequest


@dataclass(frozen=True)
class NgramProposer:
    """Proposes up to ``num_speculative_tokens`` drafts per sequence (a ``proposer.Proposer``: it
    keeps no K/V, so it ignores the target's batches and block moves).

    Attributes:
        num_speculative_tokens: most drafts per step (``k``), >= 1.
        min_n: shortest suffix that may match, >= 1.
        max_n: longest suffix tried first, >= ``min_n``.

    Raises:
        ValueError: bounds outside those.
    """

    num_speculative_tokens: int
    min_n: int = 1
    max_n: int = 4

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 1 or not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"n-gram proposer needs num_speculative_tokens >= 1 and 1 <= min_n <= max_n, got "
                             f"{self.num_speculative_tokens}, {self.min_n}, {self.max_n}")

    def propose(self, requests: Sequence[ScheduledRequest], sampler: Sampler) -> list[Proposal]:
        """Per request, the tokens its grammar forces next (none without a structured output), then
        :meth:`draft` of its known tokens followed by those, at most its lookahead in all (chosen, not
        drawn: no ``q``, and no use for ``sampler``)."""
        from pagedserve.engine.grammar_matchers import forced_tokens  # torch: on the worker only

        proposals = []
        for r in requests:
            forced = forced_tokens(r.state.matcher, r.num_lookahead_tokens)
            history = [*r.state.token_ids, *forced] if forced else r.state.token_ids  # no copy without forced ones
            looked_up = self.draft(history, limit=r.num_lookahead_tokens - len(forced))
            proposals.append(Proposal(tuple(forced + looked_up)))
        return proposals

    def observe(self, batch: ForwardBatch) -> None:
        """Nothing: drafts come from the tokens alone."""

    def move_blocks(self, plan: BatchPlan) -> None:
        """Nothing: no cache."""

    def draft(self, token_ids: Sequence[int], limit: int | None = None) -> list[int]:
        """The drafts for a sequence whose tokens so far are ``token_ids`` (none when no suffix of
        length ``min_n``.. ``max_n`` occurred before).

        Args:
            token_ids: prompt then output ids, oldest first.
            limit: at most this many drafts (e.g. what is left of ``max_tokens``); default ``k``.

        Cost: ``O(len(token_ids) * max_n)`` comparisons at most per call.
        """
        wanted = self.num_speculative_tokens if limit is None else min(limit, self.num_speculative_tokens)
        length = len(token_ids)
        if wanted <= 0:
            return []
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = list(token_ids[length - n:])
            # latest earlier start of the suffix, not the suffix itself (start <= length - n - 1)
            for start in range(length - n - 1, -1, -1):
                if token_ids[start] == suffix[0] and list(token_ids[start:start + n]) == suffix:
                    follow = list(token_ids[start + n:start + n + wanted])
                    if follow:
                        return follow
        return []
