"""Per-request logit processing before sampling: ``logit_bias`` and repetition, frequency and
presence penalties (vLLM's semantics), vectorized over the rows that ask for them.

* Repetition penalty: CTRL (Keskar et al., 2019, "CTRL: A Conditional Transformer Language Model
  for Controllable Generation", §4.1), as Hugging Face's ``RepetitionPenaltyLogitsProcessor``:
  the logit ``x`` of every token present in the prompt or the output becomes ``x / p`` when
  ``x > 0`` and ``x * p`` otherwise.
* Frequency and presence penalties: OpenAI's formula over the output tokens only,
  ``x -= c * frequency_penalty + (c > 0) * presence_penalty`` with ``c`` the token's count.
* ``logit_bias``: ``x += bias`` per listed token id.

Order, as vLLM applies them: logit bias, then repetition, frequency and presence penalties. Rows
that ask for none of them cost nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedserve.engine.sampling_params import EngineSamplingParams


@dataclass(frozen=True)
class TokenHistory:
    """The tokens a row's penalties look at.

    Attributes:
        token_ids: prompt followed by the output tokens so far.
        num_prompt_tokens: how many of ``token_ids`` are the prompt.
    """

    token_ids: Sequence[int]
    num_prompt_tokens: int


def apply_logit_bias(logits: torch.Tensor, params: Sequence[EngineSamplingParams]) -> None:
    """Adds each row's ``logit_bias`` to its logits, in place.

    Args:
        logits: float32 ``[N, V]``.
        params: ``N`` parameter sets; ids are checked against the vocabulary by ``SamplingParams.to_engine``.
    """
    rows, cols, values = [], [], []
    for row, p in enumerate(params):
        for token_id, bias in p.logit_bias:
            rows.append(row)
            cols.append(token_id)
            values.append(bias)
    if rows:
        device = logits.device
        index = (torch.tensor(rows, device=device), torch.tensor(cols, device=device))
        logits.index_put_(index, torch.tensor(values, dtype=logits.dtype, device=device), accumulate=True)


def _padded(ids: Sequence[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged id lists -> int64 ``[R, L]`` (padded with 0) and a float32 ``[R, L]`` mask of real entries."""
    width = max((len(x) for x in ids), default=0) or 1
    padded = torch.zeros(len(ids), width, dtype=torch.int64)              # (R, L)
    mask = torch.zeros(len(ids), width, dtype=torch.float32)              # (R, L)
    for i, x in enumerate(ids):
        padded[i, :len(x)] = torch.as_tensor(list(x), dtype=torch.int64)
        mask[i, :len(x)] = 1.0
    return padded.to(device), mask.to(device)


def penalize(logits: torch.Tensor, repetition: torch.Tensor, frequency: torch.Tensor, presence: torch.Tensor,
             histories: Sequence[TokenHistory]) -> torch.Tensor:
    """Applies the three penalties to ``R`` rows (see the module docstring for the formulas).

    Args:
        logits: float32 ``[R, V]``.
        repetition: float32 ``[R]``, > 0 (1 is off).
        frequency, presence: float32 ``[R]`` (0 is off).
        histories: ``R`` token histories.

    Returns:
        A new float32 ``[R, V]``.
    """
    vocab = logits.shape[1]
    all_ids, all_mask = _padded([h.token_ids for h in histories], logits.device)  # (R, L)
    seen = torch.zeros_like(logits).scatter_add_(1, all_ids, all_mask) > 0        # (R, V) prompt or output
    penalized = torch.where(logits > 0, logits / repetition[:, None], logits * repetition[:, None])  # (R, V)
    logits = torch.where(seen, penalized, logits)                                 # (R, V)
    out_ids, out_mask = _padded([h.token_ids[h.num_prompt_tokens:] for h in histories], logits.device)  # (R, L')
    counts = torch.zeros(logits.shape[0], vocab, dtype=torch.float32, device=logits.device)
    counts.scatter_add_(1, out_ids, out_mask)                                     # (R, V) output counts
    return logits - frequency[:, None] * counts - presence[:, None] * (counts > 0).float()  # (R, V)


def apply_penalties(logits: torch.Tensor, params: Sequence[EngineSamplingParams],
                    histories: Sequence[TokenHistory] | None) -> None:
    """Applies ``logit_bias`` and the penalties of the rows that ask for them, in place.

    Args:
        logits: float32 ``[N, V]``.
        params: ``N`` parameter sets.
        histories: ``N`` token histories; ``None`` only when no row has penalties.

    Raises:
        ValueError: a row has penalties but ``histories`` is ``None``.
    """
    apply_logit_bias(logits, params)
    rows = [i for i, p in enumerate(params) if p.has_penalties]
    if not rows:
        return
    if histories is None:
        raise ValueError("penalties need the rows' token histories")
    device = logits.device
    index = torch.tensor(rows, device=device)                              # (R,)
    chosen = [params[i] for i in rows]
    logits[index] = penalize(
        logits[index],
        torch.tensor([p.repetition_penalty for p in chosen], dtype=torch.float32, device=device),
        torch.tensor([p.frequency_penalty for p in chosen], dtype=torch.float32, device=device),
        torch.tensor([p.presence_penalty for p in chosen], dtype=torch.float32, device=device),
        [histories[i] for i in rows],
    )
