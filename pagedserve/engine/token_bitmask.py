"""Packed token bitmasks (32 token ids per int32 word, bit ``i % 32`` of word ``i // 32``), the layout
llguidance and xgrammar fill, and applying them to logits."""

from __future__ import annotations

import numpy as np
import torch


def bitmask_words(vocab_size: int) -> int:
    """int32 words per row for ``vocab_size`` token ids."""
    return (vocab_size + 31) // 32


def allocate_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """A CPU int32 ``[num_rows, words]`` bitmask with every token allowed (all bits set)."""
    return torch.full((num_rows, bitmask_words(vocab_size)), -1, dtype=torch.int32)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Sets to ``-inf`` (in place) the logits of the ids whose bit is clear.

    The inverted words are unpacked with ``numpy.unpackbits`` (little-endian bit order, as the
    engines fill them; several times faster on CPU than shifting int32 words in torch): a 1 byte
    is a banned id, read as the bool mask of ``masked_fill_`` with no comparison pass.

    Args:
        logits: float32 ``[R, V]``.
        bitmask: CPU int32 ``[R, ceil(V / 32)]``.
    """
    vocab = logits.shape[1]
    inverted = np.bitwise_not(bitmask.numpy()).view(np.uint8)                                  # (R, 4W)
    banned = np.unpackbits(inverted, axis=1, bitorder="little")[:, :vocab].view(np.bool_)      # (R, V)
    logits.masked_fill_(torch.from_numpy(banned).to(logits.device, non_blocking=True), float("-inf"))
