"""Counts of drafted and accepted tokens, as vLLM exports them (``vllm:spec_decode_num_drafts``,
``..._num_draft_tokens``, ``..._num_accepted_tokens``, ``..._num_accepted_tokens_per_pos``)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from pagedserve.engine.messages import SampledToken


@dataclass(frozen=True)
class SpecDecodeCounters:
    """Totals over verification steps (per step from :meth:`of`, summed with ``+``).

    Attributes:
        num_drafts: sequence-steps that verified at least one draft.
        num_draft_tokens: drafts verified.
        num_accepted_tokens: drafts accepted.
        num_accepted_tokens_per_pos: drafts accepted at draft position 0, 1, ... (a draft is only
            accepted when those before it were).
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: tuple[int, ...] = ()

    @classmethod
    def zero(cls, num_speculative_tokens: int) -> SpecDecodeCounters:
        """No drafts yet, with a per-position count for each of the ``k`` draft positions."""
        return cls(num_accepted_tokens_per_pos=(0,) * num_speculative_tokens)

    @classmethod
    def of(cls, sampled: Iterable[SampledToken]) -> SpecDecodeCounters:
        """The counts of one step's sampled tokens."""
        drafted = [s for s in sampled if s.num_draft_tokens]
        width = max((len(s.accepted) for s in drafted), default=0)
        return cls(len(drafted), sum(s.num_draft_tokens for s in drafted), sum(len(s.accepted) for s in drafted),
                   tuple(sum(len(s.accepted) > i for s in drafted) for i in range(width)))

    def __add__(self, other: SpecDecodeCounters) -> SpecDecodeCounters:
        return self._combine(other, 1)

    def __sub__(self, earlier: SpecDecodeCounters) -> SpecDecodeCounters:
        """The counts since ``earlier``, the same totals read before."""
        return self._combine(earlier, -1)

    def _combine(self, other: SpecDecodeCounters, sign: int) -> SpecDecodeCounters:
        mine, theirs = self.num_accepted_tokens_per_pos, other.num_accepted_tokens_per_pos
        width = max(len(mine), len(theirs))
        mine, theirs = mine + (0,) * (width - len(mine)), theirs + (0,) * (width - len(theirs))
        return SpecDecodeCounters(self.num_drafts + sign * other.num_drafts,
                                  self.num_draft_tokens + sign * other.num_draft_tokens,
                                  self.num_accepted_tokens + sign * other.num_accepted_tokens,
                                  tuple(a + sign * b for a, b in zip(mine, theirs)))

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verification step: 1 + accepted drafts per drafted sequence-step (vLLM's
        mean acceptance length); 1.0 before any."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0
