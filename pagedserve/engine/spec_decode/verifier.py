"""The worker's side of speculative decoding: verifying a sequence's drafts in the target step.

A speculating sequence runs its last token and its ``d`` drafts as ``d + 1`` query rows; their
logits are the target's distributions at each drafted position and one past the last. Each row
is processed as plain decoding would process it at that output index (``process_logits`` with
the history that ends with the drafts before it: penalties, bad words, ``min_tokens``, bias).
Greedy rows accept drafts while each equals the argmax and then emit the argmax after them, so
their tokens are plain decoding's; sampled rows go through the rejection sampler (Leviathan et
al. 2023 / Chen et al. 2023, ``rejection_sampler``) over the distributions plain sampling draws
from (``sampling_probs``), with uniforms derived per output index like the sampler's
(``Sampler.uniforms``): a seeded sequence's tokens are the same in every run and every batch that
drafts the same positions (a drafted position's token comes from other draws than a plain one's).
Drafts a proposer drew from its own distributions ``q`` (a draft model on a sampled sequence) are
accepted with probability ``min(1, p / q)``; chosen ones (looked up, argmax) with ``p``.

A structured output's rows are masked first, as plain decoding masks them, each by the grammar's state
after the drafts before it (``grammar_matchers.draft_masks``, from rank 0's matcher, on a copy): a draft
the grammar refuses has ``p = 0`` there and is never accepted, so the emitted tokens follow the grammar
and a greedy row's are plain decoding's. A failed matcher (a parser limit) ends the sequence at the token
drawn from it, with the failure (``SampledToken.grammar_error``), as plain decoding does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch

from pagedserve.engine.argmax import row_argmax
from pagedserve.engine.grammar_matchers import DraftMasks, apply_bitmask_rows
from pagedserve.engine.messages import AcceptedDraft, SampledToken, SequenceId
from pagedserve.engine.penalties import TokenHistory
from pagedserve.engine.sampler import Draw, Sampler, process_logits, requested_logprobs, sampling_probs
from pagedserve.engine.sampling_params import EngineSamplingParams
from pagedserve.engine.spec_decode.rejection_sampler import rejection_sample


@dataclass(frozen=True)
class Drafted:
    """A sequence whose step verifies drafts.

    Attributes:
        seq_id: the sequence.
        token_ids: its known tokens (prompt and output) before the drafts.
        num_prompt_tokens: how many of them are the prompt.
        sampling: its parameters.
        draft_token_ids: the drafts (>= 1 in a verification; a proposer drawing the next one has
            those before it).
        draft_probs: float32 ``[len(draft_token_ids), V]``, the distributions the drafts were drawn
            from, or ``None``: chosen drafts (one-hot ``q``; ``proposer.Proposal``).
        masks: a structured output's masks along the drafts (``grammar_matchers.draft_masks``), or ``None``.
    """

    seq_id: SequenceId
    token_ids: Sequence[int]
    num_prompt_tokens: int
    sampling: EngineSamplingParams
    draft_token_ids: tuple[int, ...]
    draft_probs: torch.Tensor | None = None
    masks: DraftMasks | None = None

    @property
    def num_rows(self) -> int:
        return len(self.draft_token_ids) + 1


def verify(sampler: Sampler, logits: torch.Tensor, drafted: Sequence[Drafted]) -> list[SampledToken]:
    """The tokens each drafted sequence emits: its accepted drafts, then one token from the target.

    Args:
        sampler: the worker's sampler (its generator draws the uniforms of unseeded rows).
        logits: float32 ``[R, V]``, ``R = sum(d.num_rows)``: per sequence in order, the logits of
            its last known token's row and of each draft's row; processed in place.
        drafted: the sequences.

    Returns:
        One :class:`SampledToken` per sequence, in order, with ``accepted`` and ``num_draft_tokens`` set.
    """
    starts = [0, *accumulate(d.num_rows for d in drafted)][:-1]
    structured = [(d, start) for d, start in zip(drafted, starts) if d.masks is not None]
    if structured:  # the grammar's mask first, as process_logits applies it
        apply_bitmask_rows(logits, [start + j for d, start in structured for j in range(d.num_rows)],
                           torch.cat([d.masks.bitmask for d, _ in structured]))
    params, counts = process_rows(logits, [(d, j) for d in drafted for j in range(d.num_rows)])
    emitted = _greedy(logits, drafted, starts)
    sampled = [i for i, d in enumerate(drafted) if not d.sampling.is_greedy]
    probs: dict[int, torch.Tensor] = {}  # row -> the distribution a sampled row draws from, (V,)
    if sampled:
        rows = torch.tensor([starts[i] + j for i in sampled for j in range(drafted[i].num_rows)], device=logits.device)
        row_params = [params[r] for r in rows.tolist()]
        row_probs = sampling_probs(logits[rows], row_params)              # (R', V)
        probs = dict(zip(rows.tolist(), row_probs))
        uniforms = sampler.uniforms(row_params, [counts[r] for r in rows.tolist()], num_draws=Draw.ACCEPT + 1)
        chosen = _rejection_sample(row_probs, uniforms, [drafted[i] for i in sampled])
        for i, tokens in zip(sampled, chosen):
            emitted[i] = tokens
    return _answers(logits, drafted, starts, [_until_failure(d, tokens) for d, tokens in zip(drafted, emitted)],
                    probs, params)


def _until_failure(d: Drafted, tokens: list[int]) -> tuple[list[int], str | None]:
    """``tokens`` and the failure the last one carries, as plain decoding would give them: where a row's
    matcher had failed, the tokens before that row (the next step starts from the failed matcher and
    reports it), or the first token alone with the failure when the matcher had failed before the step."""
    for j, failed in enumerate(d.masks.failures[:len(tokens)] if d.masks is not None else ()):
        if failed is not None:
            return (tokens[:j], None) if j else (tokens[:1], failed)
    return tokens, None


def process_rows(logits: torch.Tensor,
                 rows: Sequence[tuple[Drafted, int]]) -> tuple[list[EngineSamplingParams], list[int]]:
    """Processes each logits row in place as plain decoding would process the row ``j`` of its drafted
    sequence (``process_logits`` at output index ``outputs + j`` with the history ending in the first
    ``j`` drafts); returns the rows' parameters and output indices.

    Args:
        logits: float32 ``[R, V]``, one row per entry of ``rows``.
        rows: ``(sequence, j)`` pairs, ``0 <= j <= len(sequence.draft_token_ids)``.
    """
    params = [d.sampling for d, _ in rows]
    counts = [len(d.token_ids) - d.num_prompt_tokens + j for d, j in rows]
    histories = ([TokenHistory([*d.token_ids, *d.draft_token_ids[:j]], d.num_prompt_tokens) for d, j in rows]
                 if any(p.needs_history for p in params) else None)
    process_logits(logits, params, counts, histories, None)
    return params, counts


def _greedy(logits: torch.Tensor, drafted: Sequence[Drafted], starts: list[int]) -> list[list[int]]:
    """Per sequence: drafts while each equals its row's argmax, then the argmax after them."""
    argmax = row_argmax(logits).tolist()                               # (R,)
    out = []
    for d, start in zip(drafted, starts):
        accepted = 0
        while accepted < len(d.draft_token_ids) and d.draft_token_ids[accepted] == argmax[start + accepted]:
            accepted += 1
        out.append([*d.draft_token_ids[:accepted], argmax[start + accepted]])
    return out


def _rejection_sample(probs: torch.Tensor, uniforms: torch.Tensor, drafted: Sequence[Drafted]) -> list[list[int]]:
    """Rejection sampling of sampled sequences' rows (``probs`` float32 ``[R', V]``, ``uniforms``
    ``[R', 2]``: each row's draw then acceptance uniform); the drafts' ``q`` one-hot for sequences
    without ``draft_probs`` when another has them."""
    device, vocab = probs.device, probs.shape[1]
    uniforms = uniforms.to(device)
    draft_ids = torch.tensor([t for d in drafted for t in d.draft_token_ids], dtype=torch.int64, device=device)
    q = None
    if any(d.draft_probs is not None for d in drafted):
        q = torch.cat([d.draft_probs.to(device) if d.draft_probs is not None else
                       torch.nn.functional.one_hot(torch.tensor(d.draft_token_ids, device=device), vocab).to(probs.dtype)
                       for d in drafted])                                          # (D, V)
    return rejection_sample(probs, [len(d.draft_token_ids) for d in drafted], draft_ids,
                            uniforms[:, Draw.ACCEPT], uniforms[:, Draw.TOKEN], q).token_ids


def _answers(logits: torch.Tensor, drafted: Sequence[Drafted], starts: list[int],
             emitted: list[tuple[list[int], str | None]], probs: dict[int, torch.Tensor],
             params: list[EngineSamplingParams]) -> list[SampledToken]:
    """The sampled tokens (each sequence's, and the failure its last carries) with their logprobs: as
    plain decoding reports them at each emitted row."""
    rows = [starts[i] + j for i, (tokens, _) in enumerate(emitted) for j in range(len(tokens))]
    ids = [t for tokens, _ in emitted for t in tokens]
    entries = requested_logprobs(logits[torch.tensor(rows, device=logits.device)], [params[r] for r in rows],
                                 torch.tensor(ids, device=logits.device))
    out, at = [], 0
    for d, (tokens, failed) in zip(drafted, emitted):
        lps = [float(probs[r][t].log()) if r in probs else 0.0 for r, t in zip(rows[at:at + len(tokens)], tokens)]
        drafts = tuple(AcceptedDraft(t, lp, e) for t, lp, e in zip(tokens[:-1], lps, entries[at:at + len(tokens) - 1]))
        out.append(SampledToken(d.seq_id, tokens[-1], lps[-1], d.seq_id.sample_index, entries[at + len(tokens) - 1],
                                failed, accepted=drafts, num_draft_tokens=len(d.draft_token_ids)))
        at += len(tokens)
    return out
