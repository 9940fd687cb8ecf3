"""Turns a step's logits into one token per row: greedy, or filtered sampling with per-request seeds.

Per row, in order: the grammar's mask for rows with a structured output (``grammar_matchers``), min_tokens masking of stop tokens, ``allowed_token_ids`` and bad words, ``logit_bias`` and the repetition,
frequency and presence penalties (``pagedserve.engine.penalties``; only rows that ask), then
(sampled rows only) temperature; the logprobs a row asks for are taken here (log-softmax of the
processed logits, ``pagedserve.engine.logprobs``); then top-k, top-p (nucleus; Holtzman et al., 2020, "The Curious Case of Neural Text Degeneration"),
min-p (Nguyen et al., 2024, "Turning Up the Heat: Min-p Sampling"), and the draw.

The draw is inverse-transform sampling: one uniform ``u`` per row picks the first token whose
cumulative probability exceeds ``u`` (one random number per row instead of one per vocabulary
entry, as an exponential race would need). A seeded request's ``u`` for its output token ``i``
comes from a generator seeded by ``derive_seed(seed, i)`` alone, so the draw does not depend on
the other rows of the batch, nor on the worker, nor on a recompute after preemption; the token is the
same as long as the row's logits are: in float32 on a CPU with the panel GEMMs and the C++ attention
ops whatever the batch, chunking, prefix-cache hit or recompute (``attention_layout``). Elsewhere, or
when a prompt's cached blocks hold another request's output, their last bits (~2e-5 in logprobs) can
move a draw that lands on the boundary between two tokens to the neighbour.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum

import torch

from pagedserve.engine.argmax import row_argmax
from pagedserve.engine.grammar_matchers import mask_grammar
from pagedserve.engine.logprobs import token_logprobs
from pagedserve.engine.messages import TokenLogprobs
from pagedserve.engine.penalties import TokenHistory, apply_penalties
from pagedserve.engine.sampling_params import EngineSamplingParams, derive_seed


@dataclass(frozen=True)
class SamplerOutput:
    """Per row: the chosen token id, its natural-log probability under the truncated sampling
    distribution (0.0 for greedy rows), and its logprobs entry for rows that ask for ``logprobs``
    (``None`` for the others)."""

    token_ids: list[int]
    logprobs: list[float]
    token_logprobs: list[TokenLogprobs | None]


def mask_stop_tokens(logits: torch.Tensor, params: Sequence[EngineSamplingParams],
                     num_output_tokens: Sequence[int]) -> None:
    """Sets to ``-inf`` (in place) the logits of the ids that would stop a row (``StoppingParams.stop_ids``)
    while it has fewer outputs than ``min_tokens``.

    Args:
        logits: float32 ``[N, vocab]``.
        params: per row.
        num_output_tokens: per row, tokens generated before this one.
    """
    rows, cols = [], []
    for row, (p, count) in enumerate(zip(params, num_output_tokens)):
        if count < p.min_tokens:
            ids = p.stop_ids
            rows += [row] * len(ids)
            cols += ids
    if rows:
        logits[torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device)] = float("-inf")


def mask_disallowed(logits: torch.Tensor, params: Sequence[EngineSamplingParams],
                    histories: Sequence[TokenHistory] | None) -> None:
    """Sets to ``-inf`` (in place) what a row may not choose (vLLM's semantics): every id outside its
    ``allowed_token_ids``, and the last token of each of its ``bad_words_token_ids`` whose other
    tokens end the row's output so far (a one-token word: always).

    Args:
        logits: float32 ``[N, vocab]``.
        histories: per row, its tokens; only read for rows with bad words (``needs_history``).
    """
    for row, p in enumerate(params):
        if p.allowed_token_ids is not None:
            banned = torch.ones(logits.shape[1], dtype=torch.bool, device=logits.device)  # (V,)
            banned[torch.tensor(p.allowed_token_ids, device=logits.device)] = False
            logits[row].masked_fill_(banned, float("-inf"))
        if p.bad_words_token_ids:
            output = tuple(histories[row].token_ids[histories[row].num_prompt_tokens:])
            last = [word[-1] for word in p.bad_words_token_ids
                    if len(word) - 1 <= len(output) and output[len(output) - len(word) + 1:] == word[:-1]]
            logits[row, last] = float("-inf")


def _top_k_top_p_candidates(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                            num_candidates: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k/top-p over each row's ``num_candidates`` largest logits.

    Returns:
        The filtered float32 ``[R, V]`` logits, and bool ``[R]``: rows whose nucleus reaches past the
        candidates (their result is not exact and must be redone with more candidates).
    """
    vocab = logits.shape[1]
    values, order = logits.topk(num_candidates, dim=-1)                    # (R, C) descending
    rank = torch.arange(num_candidates, device=logits.device)              # (C,)
    keep = rank[None, :] < top_k[:, None]                                  # (R, C)
    values = values.masked_fill(~keep, float("-inf"))                      # (R, C)
    limited = top_k < vocab                                                # (R,) all of top-k is in C
    log_norm = torch.where(limited, values.logsumexp(dim=-1), logits.logsumexp(dim=-1))  # (R,)
    probs = (values - log_norm[:, None]).exp()                             # (R, C) renormalised
    cumulative = probs.cumsum(dim=-1)                                      # (R, C)
    nucleus = top_p < 1.0                                                  # (R,)
    keep &= ~((cumulative - probs >= top_p[:, None]) & nucleus[:, None])  # first token always kept
    incomplete = nucleus & ~limited & (cumulative[:, -1] < top_p)          # (R,)
    filtered = torch.full_like(logits, float("-inf")).scatter_(1, order, values.masked_fill_(~keep, float("-inf")))
    return filtered, incomplete


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                      candidate_sizes: tuple[int, ...] = (256, 4096)) -> torch.Tensor:
    """Keeps per row the ``top_k`` largest logits, then the smallest prefix (by probability) of those
    whose renormalised mass reaches ``top_p`` (nucleus sampling, Holtzman et al., 2020); the rest
    become ``-inf``.

    Exact, without sorting the vocabulary: each row is first filtered among its largest
    ``candidate_sizes[0]`` logits (enough whenever ``top_k`` fits, or the candidates hold ``top_p``
    of the mass); rows whose nucleus reaches further are redone with the next size, then the
    whole vocabulary.

    Args:
        logits: float32 ``[R, V]`` (temperature applied).
        top_k: int64 ``[R]``, ``V`` to keep all.
        top_p: float32 ``[R]``, 1.0 to keep all.
        candidate_sizes: increasing candidate counts tried before the full vocabulary.

    Returns:
        A new float32 ``[R, V]``.
    """
    vocab = logits.shape[1]
    finite_k = top_k[top_k < vocab]
    largest_k = int(finite_k.max()) if finite_k.numel() else 0
    sizes = [c for c in candidate_sizes if largest_k <= c < vocab] + [vocab]
    out = logits.clone()
    rows = torch.nonzero((top_k < vocab) | (top_p < 1.0)).flatten()        # rows with a filter
    for size in sizes:
        if rows.numel() == 0:
            break
        filtered, incomplete = _top_k_top_p_candidates(logits[rows], top_k[rows], top_p[rows], size)
        out[rows] = filtered
        rows = rows[incomplete]
    return out


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drops tokens whose probability is below ``min_p * max probability`` of their row (in place).

    ``logits`` float32 ``[R, V]``, ``min_p`` float32 ``[R]``; returns ``logits``.
    """
    probs = logits.softmax(dim=-1)                                        # (R, V)
    threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values   # (R, 1)
    return logits.masked_fill_(probs < threshold, float("-inf"))          # (R, V)


def process_logits(logits: torch.Tensor, params: Sequence[EngineSamplingParams], num_output_tokens: Sequence[int],
                   histories: Sequence[TokenHistory] | None, matchers: Sequence[object | None] | None) -> None:
    """The per-request processing before the choice, in place and in this order: the grammar's
    mask, min_tokens masking of stop ids, allowed ids and bad words, logit bias and penalties
    (arguments as :meth:`Sampler.__call__`'s)."""
    if matchers is not None:
        mask_grammar(logits, matchers)
    mask_stop_tokens(logits, params, num_output_tokens)
    mask_disallowed(logits, params, histories)
    apply_penalties(logits, params, histories)


def sampling_probs(logits: torch.Tensor, params: Sequence[EngineSamplingParams]) -> torch.Tensor:
    """The distribution sampled rows draw from: processed float32 ``[R, V]`` logits divided by each
    row's temperature, filtered by top-k, top-p and min-p, softmaxed; float32 ``[R, V]``."""
    device, vocab = logits.device, logits.shape[1]
    temperature = torch.tensor([p.temperature for p in params], device=device)  # (R,)
    logits = logits / temperature[:, None]                                # (R, V)
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=device)
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
        logits = apply_top_k_top_p(logits, top_k, top_p)                  # (R, V)
    if any(p.min_p > 0.0 for p in params):
        apply_min_p(logits, torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device))
    return logits.softmax(dim=-1)                                         # (R, V)


def requested_logprobs(logits: torch.Tensor, params: Sequence[EngineSamplingParams],
                       token_ids: torch.Tensor) -> list[TokenLogprobs | None]:
    """Logprobs entries of the chosen tokens for the rows whose ``logprobs`` is set, ``None`` for others.

    Args:
        logits: float32 ``[N, V]`` after masking, bias and penalties (before temperature).
        params: ``N`` parameter sets; a sampled row's logits are divided by its temperature first.
        token_ids: int64 ``[N]``, the chosen tokens.
    """
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    out: list[TokenLogprobs | None] = [None] * len(params)
    if not rows:
        return out
    index = torch.tensor(rows, device=logits.device)                      # (R,)
    temperature = torch.tensor([params[i].temperature if not params[i].is_greedy else 1.0 for i in rows],
                               dtype=torch.float32, device=logits.device)  # (R,)
    entries = token_logprobs(logits[index] / temperature[:, None], token_ids[index],
                             [params[i].logprobs for i in rows])
    for i, entry in zip(rows, entries):
        out[i] = entry
    return out


class Draw(IntEnum):
    """The uniforms of one output index (``Sampler.uniforms``' columns), each used once: the token's
    draw, the acceptance of the draft standing at that index (speculative decoding's verification),
    and the draw of that draft by a proposer that samples its drafts (``spec_decode.draft_model``)."""

    TOKEN = 0
    ACCEPT = 1
    DRAFT = 2


def inverse_transform(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-transform sampling: per row, the first token whose cumulative probability (in id order,
    summed in float64) exceeds the row's uniform times the row's total; int64 ``[R]``.

    Args:
        probs: float32 ``[R, V]``, non-negative rows (normalised or not).
        uniforms: ``[R]`` in ``[0, 1)``.
    """
    cdf = probs.to(torch.float64).cumsum_(dim=-1)                         # (R, V)
    target = uniforms.to(torch.float64) * cdf[:, -1]                      # (R,) in [0, total)
    return torch.searchsorted(cdf, target[:, None], right=True)[:, 0].clamp_(max=probs.shape[1] - 1)


class Sampler:
    """Chooses the next token for each row of a logits batch.

    Args:
        seed: seeds the generator of unseeded rows (``None``: nondeterministic).
        device: where logits arrive (the generators live there).
    """

    def __init__(self, seed: int | None = None, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._generator = torch.Generator(device=self.device)
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, params: Sequence[EngineSamplingParams],
                 num_output_tokens: Sequence[int], histories: Sequence[TokenHistory] | None = None,
                 matchers: Sequence[object | None] | None = None) -> SamplerOutput:
        """Samples one token per row.

        Args:
            logits: float32 ``[N, vocab]``; modified in place (stop-token masking, bias, penalties).
            params: ``N`` sampling parameter sets.
            num_output_tokens: ``N`` counts of tokens each request generated before this one
                (the index of the token drawn now).
            histories: ``N`` token histories (prompt + output); may be ``None`` when no row
                ``needs_history`` (the penalties read them).
            matchers: ``N`` grammar matchers (``None`` for rows without a structured output), or
                ``None`` when no row has one.

        Returns:
            ``N`` token ids and logprobs, in row order.

        Raises:
            ValueError: ``params`` or ``num_output_tokens`` length differs from ``N``, or a row has
                penalties and ``histories`` is ``None``.
        """
        if not len(params) == len(num_output_tokens) == logits.shape[0]:
            raise ValueError(f"{logits.shape[0]} logit rows, {len(params)} params, {len(num_output_tokens)} counts")
        process_logits(logits, params, num_output_tokens, histories, matchers)
        token_ids = row_argmax(logits)                                    # (N,) greedy for every row
        logprobs = torch.zeros(logits.shape[0], dtype=torch.float32, device=logits.device)  # (N,)
        sampled_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if sampled_rows:
            rows = torch.tensor(sampled_rows, device=logits.device)       # (R,)
            ids, lps = self._sample(logits[rows], [params[i] for i in sampled_rows],
                                    [num_output_tokens[i] for i in sampled_rows])
            token_ids[rows], logprobs[rows] = ids, lps
        return SamplerOutput(token_ids.tolist(), logprobs.tolist(), requested_logprobs(logits, params, token_ids))

    def _sample(self, logits: torch.Tensor, params: list[EngineSamplingParams],
                counts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Filtered sampling of ``[R, V]`` rows -> token ids int64 ``[R]`` and logprobs float32 ``[R]``."""
        probs = sampling_probs(logits, params)                            # (R, V)
        token_ids = inverse_transform(probs, self.uniforms(params, counts)[:, Draw.TOKEN])  # (R,)
        logprobs = probs.gather(1, token_ids[:, None])[:, 0].log()        # (R,)
        return token_ids, logprobs

    def uniforms(self, params: Sequence[EngineSamplingParams], counts: Sequence[int], num_draws: int = 1) -> torch.Tensor:
        """``num_draws`` ``U[0, 1)`` draws per row, float32 ``[R, num_draws]``, in :class:`Draw`'s
        order: from a generator seeded by ``(seed, output index)`` for seeded rows (a shorter call
        gets the same first draws), from the sampler's own generator otherwise."""
        draws = torch.rand(len(params), num_draws, generator=self._generator, device=self.device)  # (R, D)
        for i, (p, count) in enumerate(zip(params, counts)):
            if p.seed is not None:
                generator = torch.Generator(device=self.device).manual_seed(derive_seed(p.seed, count))
                draws[i] = torch.rand(num_draws, generator=generator, device=self.device)
        return draws
