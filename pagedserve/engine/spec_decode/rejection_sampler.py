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

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Verified:
    """What one verification step emitted.

    Attributes:
        token_ids: per row, the accepted drafts then one drawn token (1 to ``k + 1`` ids).
        num_accepted: per row, how many drafts were accepted (``len(token_ids[i]) - 1``).
    """

    token_ids: list[list[int]]
    num_accepted: list[int]


def rejection_sample(target_probs: torch.Tensor, draft_token_ids: torch.Tensor, num_drafts: torch.Tensor,
                     accept_uniforms: torch.Tensor, draw_uniforms: torch.Tensor,
                     draft_probs: torch.Tensor | None = None) -> Verified:
    """Accepts a prefix of each row's drafts and draws the token after it.

    Args:
        target_probs: float32 ``[B, k + 1, V]``, the target's distribution at each drafted position
            and one past the last (rows of a greedy request: one-hot at the argmax).
        draft_token_ids: int64 ``[B, k]``; a row's entries past its ``num_drafts`` are ignored.
        num_drafts: int64 ``[B]``, drafts per row, in ``[0, k]`` (a row with none draws one token
            from ``target_probs[:, 0]``, as plain decoding does).
        accept_uniforms: float32 ``[B, k]`` in ``[0, 1)``.
        draw_uniforms: float32 ``[B, k + 1]`` in ``[0, 1)``: ``[b, i]`` draws the token after ``i``
            accepted drafts (inverse-transform sampling over the vocabulary in id order).
        draft_probs: float32 ``[B, k, V]``, the proposer's distributions, or ``None`` for a
            proposer without one (one-hot drafts).

    Returns:
        The emitted tokens of each row (:class:`Verified`).

    Raises:
        ValueError: shapes that do not fit together.
    """
    batch, positions, vocab = target_probs.shape
    k = positions - 1
    if (draft_token_ids.shape != (batch, k) or accept_uniforms.shape != (batch, k)
            or draw_uniforms.shape != (batch, k + 1)):
        raise ValueError(f"target_probs {tuple(target_probs.shape)} needs drafts and accept_uniforms of shape "
                         f"({batch}, {k}) and draw_uniforms ({batch}, {k + 1})")
    if draft_probs is not None and draft_probs.shape != (batch, k, vocab):
        raise ValueError(f"draft_probs must be ({batch}, {k}, {vocab}), got {tuple(draft_probs.shape)}")
    rows = torch.arange(batch, device=target_probs.device)
    drafts = draft_token_ids.clamp(0, vocab - 1).unsqueeze(-1)                       # (B, k, 1)
    p_draft = target_probs[:, :k].gather(-1, drafts).squeeze(-1)                     # (B, k)
    q_draft = draft_probs.gather(-1, drafts).squeeze(-1) if draft_probs is not None else torch.ones_like(p_draft)
    in_range = torch.arange(k, device=target_probs.device) < num_drafts.unsqueeze(-1)  # (B, k)
    accepted = (accept_uniforms * q_draft < p_draft) & in_range                      # u < p / q, q > 0
    num_accepted = accepted.int().cumprod(dim=1).sum(dim=1)                          # (B,) leading run
    stop = num_accepted.clamp(max=max(k - 1, 0))
    p_next = target_probs[rows, num_accepted]                                        # (B, V)
    rejected = num_accepted < num_drafts                                             # (B,)
    if draft_probs is not None and k:
        q_next = draft_probs[rows, stop]                                             # (B, V)
    else:
        q_next = torch.zeros_like(p_next)
        if k:
            q_next[rows, draft_token_ids[rows, stop].clamp(0, vocab - 1)] = 1.0
    residual = torch.where(rejected.unsqueeze(-1), (p_next - q_next).clamp(min=0.0), p_next)
    mass = residual.sum(dim=-1, keepdim=True)
    residual = torch.where(mass > 0, residual / mass.clamp(min=torch.finfo(residual.dtype).tiny), p_next)
    cumulative = residual.cumsum(dim=-1)                                             # (B, V)
    draw = draw_uniforms[rows, num_accepted]                                         # (B,)
    drawn = torch.searchsorted(cumulative, (draw * cumulative[:, -1]).unsqueeze(-1), right=True)
    drawn = drawn.squeeze(-1).clamp(max=vocab - 1)                                   # (B,)
    counts, drafted, draws = num_accepted.tolist(), draft_token_ids.tolist(), drawn.tolist()
    return Verified([drafted[b][:counts[b]] + [draws[b]] for b in range(batch)], counts)
