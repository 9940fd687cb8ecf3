"""One forward's flat token batch over a paged KV cache: its token ids, positions and attention
metadata, built once and run by every model that keeps K/V for the same block ids (the target, and
a draft model beside it: ``spec_decode.draft_model``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pagedserve.engine.attention import (AttentionBackend, AttentionMetadata, build_attention_metadata,
                                         compute_positions)
from pagedserve.engine.attention.step import StepAttention
from pagedserve.engine.kv_cache import KVCache


@dataclass(frozen=True)
class ForwardBatch:
    """Each sequence's new tokens after its computed ones, flat (``T`` tokens in all).

    Attributes:
        input_ids: int64 ``[T]`` on the model's device.
        positions: int64 ``[T]`` on the model's device, each token's position in its sequence.
        metadata: slot mapping, block tables and lengths (``build_attention_metadata``).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata

    @classmethod
    def build(cls, token_ids: Sequence[int], query_lens: Sequence[int], context_lens: Sequence[int],
              block_tables: Sequence[Sequence[int]], block_size: int, dtype: torch.dtype,
              device: torch.device, num_decode_seqs: int | None = None) -> ForwardBatch:
        """The batch of ``token_ids`` (``sum(query_lens)``, sequence after sequence), sequence ``i``
        having ``context_lens[i]`` tokens cached in the blocks ``block_tables[i]``; ``dtype`` is the
        models' activation dtype (of the masks); ``num_decode_seqs`` as ``build_attention_metadata``
        takes it. Raises ValueError as ``build_attention_metadata``."""
        positions = compute_positions(query_lens, context_lens)           # (T,) int64
        metadata = build_attention_metadata(query_lens, context_lens, block_tables, positions, block_size, dtype,
                                            device, num_decode_seqs=num_decode_seqs)
        input_ids = torch.tensor(token_ids, dtype=torch.int64, device=device)  # (T,)
        return cls(input_ids, positions.to(device), metadata)

    def run(self, forward: Callable[..., torch.Tensor], kv_cache: KVCache, backend: AttentionBackend) -> torch.Tensor:
        """``forward(input_ids, positions, attention)`` over this batch, writing K/V into ``kv_cache``:
        hidden states ``[T, hidden]``."""
        return forward(self.input_ids, self.positions, StepAttention(kv_cache, self.metadata, backend))
