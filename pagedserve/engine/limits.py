"""How much of a sequence fits in an iteration, and whether it can ever run."""

from __future__ import annotations

from collections.abc import Sequence as Seq

from pagedserve.engine.config import SchedulerConfig
from pagedserve.engine.sequence import Sequence


def num_new_tokens(seq: Sequence, token_budget: int, config: SchedulerConfig, num_computed: int | None = None) -> int:
    """Tokens to compute now: all that remain, or a chunk of the budget; 0 when a prefill must run
    whole (chunked prefill off) and does not fit in what is left of the budget."""
    remaining = seq.num_tokens - (seq.num_computed_tokens if num_computed is None else num_computed)
    if remaining > token_budget and not config.enable_chunked_prefill:
        return 0
    return min(remaining, token_budget)


def rejection_reason(seq: Sequence, worker_blocks: Seq[int], config: SchedulerConfig) -> str | None:
    """Why no worker could ever run ``seq``, or ``None`` when one could (or none registered yet).

    Args:
        worker_blocks: each registered worker's KV capacity in blocks.
    """
    if not worker_blocks:
        return None  # wait for workers to register
    capacity = max(worker_blocks) * config.block_size
    if seq.num_tokens > capacity:
        return f"the prompt needs {seq.num_tokens} KV slots, more than the largest worker's KV cache holds ({capacity})"
    if not config.enable_chunked_prefill and seq.num_tokens > config.max_num_batched_tokens:
        return (f"the prompt has {seq.num_tokens} tokens, more than max_num_batched_tokens "
                f"({config.max_num_batched_tokens}) and chunked prefill is off")
    return None
