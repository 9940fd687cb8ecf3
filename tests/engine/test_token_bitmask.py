"""Packed token bitmasks applied to logits: exactly the ids whose bit is clear become -inf, for
widths that are and are not a multiple of 32, against the bits shifted out in torch."""

from __future__ import annotations

import pytest
import torch

from pagedserve.engine.token_bitmask import allocate_bitmask, apply_bitmask, bitmask_words


@pytest.mark.parametrize("vocab", [32, 100, 49152])
def test_apply_bitmask_bans_exactly_the_clear_bits(vocab):
    generator = torch.Generator().manual_seed(vocab)
    rows = 5
    bitmask = allocate_bitmask(rows, vocab)
    assert bitmask.shape == (rows, bitmask_words(vocab)) and bool((bitmask == -1).all())
    bitmask[1:] = torch.randint(-2**31, 2**31 - 1, (rows - 1, bitmask.shape[1]), generator=generator,
                                dtype=torch.int32)
    bitmask[2] = 0  # every id banned
    logits = torch.randn(rows, vocab, generator=generator)
    bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1     # (R, W, 32): bit i % 32 of word i // 32
    expected = logits.masked_fill(bits.reshape(rows, -1)[:, :vocab] == 0, float("-inf"))
    apply_bitmask(logits, bitmask)
    assert torch.equal(logits, expected)
    assert bool(torch.isfinite(logits[0]).all())  # row 0 keeps every id
    assert bool(torch.isneginf(logits[2]).all())
