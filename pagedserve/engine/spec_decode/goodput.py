"""How many drafts a step verifies, chosen for goodput (``--speculative-control goodput``).

Verifying a draft costs a query row in the target's step. At batch 1 on a CPU the step is bound by
reading the weights and a few more rows are almost free, so drafts pay whenever some are accepted;
at batch 64 the step is bound by arithmetic, a row costs about what a decode costs, and drafts pay
only if nearly all of them are accepted (64 ShareGPT requests with n-gram drafts on 2 cores:
0.84x the output tokens/s of plain decoding with every decode drafting). So, as SmartSpec does
(Liu et al. 2024, "Optimizing Speculative Decoding for Serving Large Language Models Using
Goodput", arXiv:2406.14066, §4), each step's lookahead ``k`` (the same for all of a worker's
decodes in that step, 0 up to ``num_speculative_tokens``) maximizes the expected output tokens per
second of the step::

    goodput(k) = (decodes + n * sum_{i<k} filled_i * accepted_i) / step_seconds(k)

where ``n`` decodes may speculate, ``step_seconds`` is the worker's fitted step cost (``step_cost``)
of its decodes plus the expected draft rows ``n * filled_i`` and their attention pairs,
``filled_i`` is how often the proposer filled draft position ``i`` when a slot was reserved for it
(prompt lookup finds nothing to draft for many sequences: an empty slot costs nothing) and
``accepted_i`` how often a draft at position ``i`` was accepted. Both are counted over the worker's
answers (:class:`DraftStats`), decaying by :data:`DECAY` per answered step towards a prior of every
slot filled and every draft accepted: estimates of a workload that no longer drafts become hopeful
again after tens to a few hundred steps, and one step with drafts measures them afresh.

Greedy outputs do not depend on ``k`` (drafts only decide how many tokens a step yields); sampled
outputs keep their distribution, their draws depend on where drafts were verified.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence as Seq

from pagedserve.engine.step_cost import StepCost

DECAY = 0.97
"""What an observation still counts for after each further answered step (half-life ~23 steps)."""
PRIOR = 1.0
"""Pseudo-observations of a filled slot and an accepted draft that every estimate starts from."""


class DraftStats:
    """One worker's draft outcomes per draft position, as counts decayed by :data:`DECAY` per answered
    step (positions never reserved read as the prior).

    Not thread-safe: the scheduler's thread feeds and reads it.
    """

    def __init__(self) -> None:
        self.reserved: list[float] = []  # slots reserved at position i
        self.filled: list[float] = []  # of those, drafts the proposer put there
        self.accepted: list[float] = []  # of those, drafts accepted

    def observe(self, outcomes: Iterable[tuple[int, int, int]]) -> None:
        """Counts one answered step's speculative decodes, each as (slots reserved, drafts verified,
        drafts accepted), after decaying what was counted before."""
        for counts in (self.reserved, self.filled, self.accepted):
            counts[:] = [c * DECAY for c in counts]
        for slots, drafts, accepted in outcomes:
            if slots > len(self.reserved):
                for counts in (self.reserved, self.filled, self.accepted):
                    counts.extend([0.0] * (slots - len(counts)))
            for i in range(slots):
                self.reserved[i] += 1
                self.filled[i] += i < drafts
                self.accepted[i] += i < accepted

    def fill_rate(self, position: int) -> float:
        """Expected drafts at ``position`` per slot reserved there, in (0, 1]."""
        if position >= len(self.reserved):
            return 1.0
        return (self.filled[position] + PRIOR) / (self.reserved[position] + PRIOR)

    def accept_rate(self, position: int) -> float:
        """Expected accepted drafts at ``position`` per draft put there, in (0, 1]."""
        if position >= len(self.filled):
            return 1.0
        return (self.accepted[position] + PRIOR) / (self.filled[position] + PRIOR)


def best_lookahead(stats: DraftStats, cost: StepCost | None, decode_contexts: Seq[int], speculating: Seq[int],
                   max_lookahead: int) -> int:
    """The lookahead ``k`` in ``0..max_lookahead`` of highest expected goodput (module docstring) for
    a step of one-token decodes after ``decode_contexts`` computed tokens each, of which those after
    ``speculating`` may draft; ``max_lookahead`` when nothing is known of the step's cost yet (no
    step answered) or the fit has no fixed cost (its steps were all alike, or none had a prefill: it
    cannot tell whether drafts pay, and steps with drafts give it other sizes), 0 when none may draft.
    Ties go to the smaller ``k``."""
    if not speculating or max_lookahead == 0:
        return 0
    if cost is None or cost.fixed_s <= 0:
        return max_lookahead
    tokens, pairs = float(len(decode_contexts)), float(sum(decode_contexts) + len(decode_contexts))
    emitted = tokens
    best, best_goodput = 0, emitted / cost.step_seconds(tokens, pairs, tokens)
    n, context_sum = len(speculating), sum(speculating)
    for position in range(max_lookahead):
        rows = n * stats.fill_rate(position)  # expected draft rows at this position over the step
        tokens += rows
        pairs += rows * (context_sum / n + position + 2)  # each row attends to its context and the rows before it
        emitted += rows * stats.accept_rate(position)
        goodput = emitted / cost.step_seconds(tokens, pairs, tokens)
        if goodput > best_goodput:
            best, best_goodput = position + 1, goodput
    return best
