"""Log-probabilities of chosen tokens and their top alternatives, in float32 (vLLM's semantics).

Only rows that ask for them pay for the log-softmax over the vocabulary; a greedy row without
``logprobs`` stays argmax-only.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pagedserve.engine.messages import PromptLogprobs, SequenceId, TokenLogprobs


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: Sequence[int]) -> list[TokenLogprobs]:
    """The logprob, rank and top alternatives of one chosen token per row.

    Args:
        logits: ``[R, V]`` (any float dtype; computed in float32): the distribution's logits.
        token_ids: int64 ``[R]``: the token whose logprob is reported, per row.
        num_top: ``R`` counts of alternatives to report, each in [0, V].

    Returns:
        ``R`` entries in row order; ``rank`` is the number of tokens whose logprob is >= the chosen one's (1 for
        the most likely, as vLLM counts), alternatives most likely first: at most ``num_top``, none at ``-inf``
        (a token the request's grammar, ``min_tokens``, ``bad_words`` or ``allowed_token_ids`` rules out is no
        alternative; where fewer tokens than asked are possible, which of the impossible ones tied at ``-inf`` a
        top-k listed changed with the batch).
    """
    logprobs = torch.log_softmax(logits.float(), dim=-1)                    # (R, V) float32
    chosen = logprobs.gather(1, token_ids[:, None])                         # (R, 1)
    ranks = (logprobs >= chosen).sum(dim=-1)                                # (R,)
    k = max(num_top, default=0)
    top_values, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], token_ids[:, None][:, :0])  # (R, k)
    chosen_list, rank_list = chosen[:, 0].tolist(), ranks.tolist()
    values_list, ids_list = top_values.tolist(), top_ids.tolist()
    entries = []
    for i, t in enumerate(token_ids.tolist()):
        possible = [n for n, value in enumerate(values_list[i][:num_top[i]]) if value != -math.inf]
        entries.append(TokenLogprobs(int(t), chosen_list[i], rank_list[i], tuple(ids_list[i][n] for n in possible),
                                     tuple(values_list[i][n] for n in possible)))
    return entries


@dataclass(frozen=True)
class PromptChunk:
    """The prompt positions one step computes for a sequence that asks for ``prompt_logprobs``.

    Attributes:
        seq_id: the sequence.
        prompt_token_ids: its prompt.
        first_row: row in the step's flat hidden states of the token at position ``start``.
        start: prompt position of the chunk's first token.
        end: positions ``start .. end - 1`` predict prompt tokens ``start + 1 .. end`` (``end``
            at most the prompt length - 1).
        num_top: alternatives per position.
    """

    seq_id: SequenceId
    prompt_token_ids: Sequence[int]
    first_row: int
    start: int
    end: int
    num_top: int


def prompt_logprobs(hidden: torch.Tensor, compute_logits: Callable[[torch.Tensor], torch.Tensor],
                    chunks: Sequence[PromptChunk]) -> list[PromptLogprobs]:
    """Logprobs of the prompt tokens a step's chunks predict, from the raw logits (as vLLM's).

    Args:
        hidden: ``[T, hidden]`` hidden states of the step's flat token batch.
        compute_logits: the model's head, ``[R, hidden] -> float32 [R, V]``.
        chunks: one per sequence that asks (one chunk's logits at a time, so at most
            ``token budget x V`` float32 values live at once).

    Returns:
        One :class:`PromptLogprobs` per chunk with ``end > start``, positions ``start + 1 .. end``.
    """
    out = []
    for c in chunks:
        if c.end <= c.start:
            continue
        rows = torch.arange(c.first_row, c.first_row + c.end - c.start, device=hidden.device)  # (P,)
        logits = compute_logits(hidden[rows])                                 # (P, V) float32
        targets = torch.tensor(list(c.prompt_token_ids[c.start + 1:c.end + 1]), device=logits.device)  # (P,)
        entries = token_logprobs(logits, targets, [c.num_top] * len(targets))
        out.append(PromptLogprobs(c.seq_id, c.start + 1, tuple(entries)))
    return out
