"""How much of a sequence fits in an iteration, and whether it can ever run."""

from __future__ import annotations

from collections.abc import Sequence as Seq

from pagedserve.engine.config import SchedulerConfig
from pagedserve.engine.messages import RequestError
from pagedserve.engine.request_errors import ErrorKind
from pagedserve.engine.sequence import Sequence
from pagedserve.engine.worker_state import PlanDraft

MAX_WORKER_LOSSES = 3
"""A sequence whose worker failed or went away this often ends instead of being recomputed again."""

LOST_TOKEN_ERROR = RequestError(ErrorKind.UNAVAILABLE, "the worker's answer to a step lacked this request's next "
                                "token (a scheduler error, in its log); retry the request")
"""What a sequence ends with when the answer of the step that was to sample its next token lacks it
(a bug: it would wait for that token for ever otherwise)."""


def grammar_failure(reason: str) -> RequestError:
    """How a request whose grammar the worker cannot run ends (it does not build against the
    vocabulary, or fails at a parser limit while decoding): INVALID_ARGUMENT with ``reason``."""
    return RequestError(ErrorKind.INVALID_ARGUMENT, reason)


def num_new_tokens(seq: Sequence, draft: PlanDraft, config: SchedulerConfig, num_computed: int | None = None,
                   share: float = 1.0, reserve: int = 0) -> int:
    """Tokens to compute now: with chunked prefill, ``PlanDraft.chunk_tokens`` (a decode, or a
    chunk sized by ``share`` of the step's prefill room, token budget and time, or by all of it but
    ``reserve`` tokens when that is more); without, all that remain, or 0 when they do not fit in what
    is left of the budget."""
    computed = seq.num_computed_tokens if num_computed is None else num_computed
    remaining = seq.num_tokens + seq.num_tokens_in_flight - computed
    if not config.enable_chunked_prefill:
        return remaining if remaining <= draft.token_budget else 0
    return draft.chunk_tokens(computed, remaining, share, reserve)


def cache_holds(num_tokens: int, num_blocks: int, config: SchedulerConfig) -> bool:
    """Whether a KV cache of ``num_blocks`` blocks holds ``num_tokens`` slots."""
    return num_tokens <= num_blocks * config.block_size


def fits_worker(num_tokens: int, num_blocks: int, token_budget: int, config: SchedulerConfig) -> bool:
    """Whether a worker of ``num_blocks`` KV blocks and ``token_budget`` could ever run a prompt of ``num_tokens``:
    its KV cache holds it, and with chunked prefill off its budget takes the prompt in one step."""
    return cache_holds(num_tokens, num_blocks, config) and (config.enable_chunked_prefill or num_tokens <= token_budget)


def rejection_reason(seq: Sequence, workers: Seq[tuple[int, int]], config: SchedulerConfig) -> str | None:
    """Why no worker could ever run ``seq`` (:func:`fits_worker`), or ``None`` when one could (or none
    registered yet).

    Args:
        workers: each registered worker's KV capacity in blocks and token budget.
    """
    if not workers or any(fits_worker(seq.num_tokens, blocks, budget, config) for blocks, budget in workers):
        return None  # one can, or wait for workers to register
    holding = [budget for blocks, budget in workers if cache_holds(seq.num_tokens, blocks, config)]
    if not holding:
        capacity = max(blocks for blocks, _ in workers) * config.block_size
        return f"the prompt needs {seq.num_tokens} KV slots, more than the largest worker's KV cache holds ({capacity})"
    return (f"the prompt has {seq.num_tokens} tokens, more than the token budget (max_num_batched_tokens) of every "
            f"worker whose KV cache holds it (at most {max(holding)}), and chunked prefill is off")


def rejection_error(seq: Sequence, workers: Seq[tuple[int, int]], config: SchedulerConfig) -> RequestError | None:
    """``rejection_reason`` as the error the request ends with (``RESOURCE_EXHAUSTED``), or ``None``."""
    reason = rejection_reason(seq, workers, config)
    return None if reason is None else RequestError(ErrorKind.RESOURCE_EXHAUSTED, reason)


def worker_loss_error(seq: Sequence) -> RequestError | None:
    """The error ``seq`` ends with once it has lost ``MAX_WORKER_LOSSES`` workers (a request that
    brings down every worker it runs on must not go on forever), or ``None``."""
    if seq.num_worker_losses < MAX_WORKER_LOSSES:
        return None
    return RequestError(ErrorKind.UNAVAILABLE, f"the workers running this request failed {seq.num_worker_losses} "
                                          "times; retry later")
