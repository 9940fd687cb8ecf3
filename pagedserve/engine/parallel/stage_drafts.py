"""Speculative drafts over pipeline stages: the first stage drafts, and each stage hands the drafts to
the next before the step's forward.

Every stage needs a step's drafts before its forward (they are rows of the verification batch, whose
layout every stage shares), and the last stage needs ``q`` too (the distributions sampled drafts were
drawn from: the rejection sampler's). The first stage knows a step's tokens first (a plan of a virtual
engine goes out only after its previous answer, whose tokens come with it: ``pipeline.py``), so its
proposer drafts: the n-gram proposer, or a draft model with its own KV cache, in that stage only (its
tensor-parallel rank 0 when the stage has several ranks, sharing the ids with the others as on a
tensor-parallel worker: ``rank.LeaderProposer``). The drafts then go down the stages beside the hidden
states, over the same point-to-point links (``StageForward.send_next``/``recv_prev``: each rank to the
same tensor-parallel rank of the next stage, the time counted as the stage's communication): a rank
sends them before the step's activations, so the order on each link holds. Only tensor-parallel rank
0's link carries ``q`` (the rank that verifies on the last stage); it arrives on the CPU (the verifier
moves it to the logits' device). No message names its step: every rank runs the same plans in the same
order (``pipeline_runner.py``), and a rank that fails is not used again.

The last stage's accepted drafts come back to the other stages with the tokens of the engine's next plan
(``StageRunner.append_sampled``), as for any step.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from pagedserve.engine.forward_batch import ForwardBatch
from pagedserve.engine.messages import BatchPlan
from pagedserve.engine.parallel.group import CollectiveError
from pagedserve.engine.spec_decode.proposer import Proposal, Proposer
from pagedserve.engine.worker_requests import ScheduledRequest

FAILED = -1
"""A header count that says the first stage's proposer failed (the next stages raise too)."""


def draft_seed(seed: int | None) -> int | None:
    """The seed of a first stage's sampler, which only draws drafts, derived from the worker's ``seed``
    (equal seeds on the first and the last stage would draw a request's draft and its acceptance test
    from the same uniforms when the request has no seed of its own); ``None`` stays ``None``."""
    return None if seed is None else int.from_bytes(hashlib.sha256(f"{seed}/drafts".encode()).digest()[:7], "big")


class StageDrafts:
    """A pipeline rank's proposer (``spec_decode.proposer.Proposer``): the first stage's drafts, passed on.

    Args:
        proposer: the first stage's proposer (its leader or follower on a tensor-parallel stage);
            ``None`` on the other stages, which receive the drafts.
        links: the rank's links to its neighbour stages (``send_next(tensor)``, ``recv_prev(tensor)``:
            the rank's ``StageForward``).
        is_last: whether this rank is on the last stage (it passes nothing on).
        vocab_size: the width of ``q``'s rows.
    """

    def __init__(self, proposer: Proposer | None, links, is_last: bool, vocab_size: int) -> None:
        self.proposer = proposer
        self.links = links
        self.is_last = is_last
        self.vocab_size = vocab_size

    def propose(self, requests: Sequence[ScheduledRequest], sampler: object) -> list[Proposal]:
        """The first stage's proposals for ``requests`` (every stage applies the same plan to equal
        states, so all call this with the same requests), drafted here or received from the stage
        before; passed on to the next stage.

        Raises:
            CollectiveError: a neighbour stage failed or timed out, or the first stage's proposer failed.
            What the first stage's proposer raises (on that stage).
        """
        if self.proposer is None:
            proposals = self._receive(len(requests))
        else:
            try:
                proposals = self.proposer.propose(requests, sampler)
            except Exception:
                self._send_failure(len(requests))
                raise
        if not self.is_last:
            self._send(proposals)
        return proposals

    def observe(self, batch: ForwardBatch) -> None:
        """The target's batch, on the first stage (where a draft model keeps its K/V)."""
        if self.proposer is not None:
            self.proposer.observe(batch)

    def move_blocks(self, plan: BatchPlan) -> None:
        """The plan's block moves, on the first stage (the draft model's cache)."""
        if self.proposer is not None:
            self.proposer.move_blocks(plan)

    def _send(self, proposals: Sequence[Proposal]) -> None:
        """Header int64 ``[2R]`` (draft counts, then 1 where ``q`` follows), the ids int64 ``[D]``, and
        ``q`` float32 ``[D_q, V]`` of the proposals that have one (each only if not empty)."""
        counts = [len(p.token_ids) for p in proposals]
        with_q = [p.probs is not None and len(p.token_ids) > 0 for p in proposals]
        self.links.send_next(torch.tensor(counts + [int(b) for b in with_q], dtype=torch.int64))
        if sum(counts):
            self.links.send_next(torch.tensor([t for p in proposals for t in p.token_ids], dtype=torch.int64))
        if any(with_q):
            self.links.send_next(torch.cat([p.probs for p, b in zip(proposals, with_q) if b]).float())

    def _send_failure(self, num_requests: int) -> None:
        if not self.is_last:
            self.links.send_next(torch.full((2 * num_requests,), FAILED, dtype=torch.int64))

    def _receive(self, num_requests: int) -> list[Proposal]:
        header = self.links.recv_prev(torch.empty(2 * num_requests, dtype=torch.int64)).tolist()
        if FAILED in header:
            self._send_failure(num_requests)
            raise CollectiveError("the first pipeline stage failed to draft this step's tokens")
        counts, with_q = header[:num_requests], header[num_requests:]
        ids = (self.links.recv_prev(torch.empty(sum(counts), dtype=torch.int64)).tolist()
               if sum(counts) else [])
        num_q = sum(n for n, b in zip(counts, with_q) if b)
        q = self.links.recv_prev(torch.empty(num_q, self.vocab_size)) if num_q else None
        proposals, at, q_at = [], 0, 0
        for n, b in zip(counts, with_q):
            probs = q[q_at:q_at + n] if b else None
            proposals.append(Proposal(tuple(ids[at:at + n]), probs))
            at, q_at = at + n, q_at + (n if b else 0)
        return proposals
