"""Verifying proposed tokens in one target step: speculative sampling's rejection sampler.

The algorithm is Leviathan et al., "Fast Inference from Transformers via Speculative Decoding"
(ICML 2023, Algorithm 1) and Chen et al., "Accelerating Large Language Model Decoding with
Speculative Sampling" (2023, Algorithm 2). A proposer drafted ``k`` tokens ``x_1..x_k`` from its
distributions ``q_1..q_k``; one target step scored the context plus the drafts, giving the target's
distributions ``p_1..p_{k+1}`` at each drafted position and one past the last. Going left to right,
draft ``x_i`` is accepted with probability ``min(1, p_i(x_i) / q_i(x_i))``; at the first rejection a
token is drawn from the residual ``max(0, p_i - q_i)`` (normalised) and the row stops there; if all
``k`` are accepted a bonus token is drawn from ``p_{k+1}``. Every emitted token then has exactly the
target's distribution, so sampled outputs keep it and greedy ones (``p`` one-hot at the argmax)
are the target's argmax tokens: token-identical to decoding without speculation.

A proposer that looks tokens up (n-gram / prompt lookup) has no distribution: its ``q_i`` is
one-hot at ``x_i``, so a draft is accepted with probability ``p_i(x_i)`` and the residual is ``p_i``
without ``x_i``.

Random numbers come in as arguments (one acceptance uniform per drafted position, one draw uniform
per position, of which the one after the accepted drafts is used): the caller derives them per request and output index, as the sampler does, so a
seeded request's tokens do not depend on its batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch


@dataclass(frozen=True)
class Verified:
    """What one verification step emitted.

    Attributes:
        token_ids: per sequence, the accepted drafts then one drawn token (1 to ``k + 1`` ids).
        num_accepted: per sequence, how many drafts were accepted (``len(token_ids[i]) - 1``).
    """

    token_ids: list[list[int]]
    num_accepted: list[int]


def rejection_sample(target_probs: torch.Tensor, num_drafts: Sequence[int], draft_token_ids: torch.Tensor,
                     accept_uniforms: torch.Tensor, draw_uniforms: torch.Tensor,
                     draft_probs: torch.Tensor | None = None) -> Verified:
    """Accepts a prefix of each sequence's drafts and draws the token after it.

    Rows are ragged, as the verification step computed them: sequence ``b`` with ``n_b =
    num_drafts[b]`` drafts owns ``n_b + 1`` consecutive rows (its drafted positions, then one past the
    last) of the per-row tensors and ``n_b`` consecutive entries of the per-draft ones. Only one row per
    sequence (the one after its accepted drafts) is read whole, so memory is ``O(B * V)`` besides the
    inputs.

    Args:
        target_probs: float32 ``[R, V]``, ``R = sum(n_b + 1)``: the target's distribution at each row
            (rows of a greedy request: one-hot at the argmax).
        num_drafts: ``B`` counts, each ``>= 0`` (a sequence with none draws one token from its row, as
            plain decoding does).
        draft_token_ids: int64 ``[D]``, ``D = sum(n_b)``.
        accept_uniforms: float32 ``[R]`` in ``[0, 1)``: a row's accepts the draft checked at it (a
            sequence's last row's is not read).
        draw_uniforms: float32 ``[R]`` in ``[0, 1)``: a row's draws the token after as many accepted
            drafts (inverse-transform sampling over the vocabulary in id order).
        draft_probs: float32 ``[D, V]``, the distribution each draft was drawn from, or ``None`` for a
            proposer without one (one-hot drafts).

    Returns:
        The emitted tokens of each sequence (:class:`Verified`).

    Raises:
        ValueError: shapes that do not fit together.
    """
    rows, vocab = target_probs.shape
    counts = list(num_drafts)
    drafts_total, device = sum(counts), target_probs.device
    if (rows != drafts_total + len(counts) or draft_token_ids.shape != (drafts_total,)
            or accept_uniforms.shape != (rows,) or draw_uniforms.shape != (rows,)):
        raise ValueError(f"{len(counts)} sequences with {drafts_total} drafts need target_probs, accept_uniforms and "
                         f"draw_uniforms of {drafts_total + len(counts)} rows and draft_token_ids of {drafts_total}, "
                         f"got {rows}, {tuple(accept_uniforms.shape)}, {tuple(draw_uniforms.shape)} and "
                         f"{tuple(draft_token_ids.shape)}")
    if draft_probs is not None and draft_probs.shape != (drafts_total, vocab):
        raise ValueError(f"draft_probs must be ({drafts_total}, {vocab}), got {tuple(draft_probs.shape)}")
    row_starts = [0, *accumulate(n + 1 for n in counts)][:-1]
    draft_starts = [0, *accumulate(counts)][:-1]
    drafts = draft_token_ids.clamp(0, vocab - 1)                                     # (D,)
    draft_rows = torch.tensor([r + j for r, n in zip(row_starts, counts) for j in range(n)], dtype=torch.int64,
                              device=device)
    p_draft = target_probs[draft_rows, drafts]                                       # (D,)
    q_draft = (draft_probs[torch.arange(drafts_total, device=device), drafts] if draft_probs is not None
               else torch.ones_like(p_draft))
    accepted = (accept_uniforms[draft_rows] * q_draft < p_draft).tolist()            # u < p / q, q > 0
    num_accepted = [_leading_run(accepted[d:d + n]) for d, n in zip(draft_starts, counts)]
    next_rows = torch.tensor([r + a for r, a in zip(row_starts, num_accepted)], device=device)
    p_next = target_probs[next_rows]                                                 # (B, V)
    rejected = [b for b, (a, n) in enumerate(zip(num_accepted, counts)) if a < n]
    q_next = torch.zeros_like(p_next)
    if rejected:
        at = torch.tensor([draft_starts[b] + num_accepted[b] for b in rejected], device=device)
        which = torch.tensor(rejected, device=device)
        if draft_probs is not None:
            q_next[which] = draft_probs[at]
        else:
            q_next[which, drafts[at]] = 1.0
    residual = (p_next - q_next).clamp(min=0.0)                                      # q_next is 0 where nothing was rejected
    mass = residual.sum(dim=-1, keepdim=True)
    residual = torch.where(mass > 0, residual / mass.clamp(min=torch.finfo(residual.dtype).tiny), p_next)
    cumulative = residual.cumsum(dim=-1)                                             # (B, V)
    draw = draw_uniforms[next_rows]                                                  # (B,)
    drawn = torch.searchsorted(cumulative, (draw * cumulative[:, -1]).unsqueeze(-1), right=True)
    draws = drawn.squeeze(-1).clamp(max=vocab - 1).tolist()                         # (B,)
    ids = draft_token_ids.tolist()
    return Verified([ids[d:d + a] + [t] for d, a, t in zip(draft_starts, num_accepted, draws)], num_accepted)


def _leading_run(flags: Sequence[bool]) -> int:
    """How many of ``flags`` are true before the first false one."""
    return next((i for i, f in enumerate(flags) if not f), len(flags))
