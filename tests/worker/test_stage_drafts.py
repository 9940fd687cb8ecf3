"""Drafts passed down pipeline stages (``parallel/stage_drafts.py``): every stage gets the first stage's
draft ids for each request, ``q`` where it was drawn, nothing for requests without drafts; a failure of
the first stage's proposer makes every later stage raise instead of waiting for drafts that never come.
The point-to-point links are in-memory queues here (their gloo sends are tested with real ranks in
test_pipeline_parallel_llm.py)."""

from __future__ import annotations

from collections import defaultdict, deque

import pytest
import torch

from pagedserve.engine.parallel.group import CollectiveError
from pagedserve.engine.parallel.stage_drafts import StageDrafts, draft_seed
from pagedserve.engine.spec_decode.proposer import Proposal

VOCAB = 5


class Links:
    """One stage's ``send_next``/``recv_prev`` over in-memory FIFOs, one per pair of neighbour stages."""

    def __init__(self, stage: int, queues: dict[int, deque[torch.Tensor]]) -> None:
        self.stage, self.queues = stage, queues

    def send_next(self, tensor: torch.Tensor) -> None:
        self.queues[self.stage].append(tensor.clone())

    def recv_prev(self, tensor: torch.Tensor) -> torch.Tensor:
        sent = self.queues[self.stage - 1].popleft()
        assert sent.shape == tensor.shape and sent.dtype == tensor.dtype, (sent.shape, tensor.shape)
        return tensor.copy_(sent)


class Fixed:
    """A proposer that returns the given proposals (or raises ``error``)."""

    def __init__(self, proposals: list[Proposal] | None = None, error: Exception | None = None) -> None:
        self.proposals, self.error = proposals, error

    def propose(self, requests, sampler) -> list[Proposal]:
        if self.error is not None:
            raise self.error
        return self.proposals


def _stages(first: Fixed, num_stages: int = 3) -> list[StageDrafts]:
    queues: dict[int, deque[torch.Tensor]] = defaultdict(deque)
    return [StageDrafts(first if s == 0 else None, Links(s, queues), s == num_stages - 1, VOCAB)
            for s in range(num_stages)]


def test_every_stage_gets_the_first_stages_ids_and_q_where_drawn():
    q = torch.softmax(torch.randn(2, VOCAB), -1)
    sent = [Proposal((4, 1)), Proposal(()), Proposal((3, 2), q), Proposal((0,))]
    stages = _stages(Fixed(sent))
    requests = [object()] * len(sent)  # only their number matters to the stages after the first
    got = [stage.propose(requests, None) for stage in stages]
    for proposals in got:
        assert [p.token_ids for p in proposals] == [(4, 1), (), (3, 2), (0,)]
        assert [p.probs is None for p in proposals] == [True, True, False, True]
        assert torch.equal(proposals[2].probs, q)


def test_no_drafts_at_all_sends_only_the_header():
    stages = _stages(Fixed([Proposal(()), Proposal(())]))
    got = [stage.propose([object()] * 2, None) for stage in stages]
    assert all([p.token_ids for p in proposals] == [(), ()] for proposals in got)


def test_the_draft_sampler_seed_differs_from_the_workers_and_repeats():
    assert draft_seed(None) is None
    assert draft_seed(7) == draft_seed(7) != 7 and draft_seed(7) != draft_seed(8)


def test_a_failed_first_stage_makes_every_later_stage_raise():
    stages = _stages(Fixed(error=ValueError("draft model broke")))
    with pytest.raises(ValueError, match="draft model broke"):
        stages[0].propose([object()] * 3, None)
    for stage in stages[1:]:
        with pytest.raises(CollectiveError, match="first pipeline stage failed to draft"):
            stage.propose([object()] * 3, None)
