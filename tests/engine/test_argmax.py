"""row_argmax: the index argmax(dim=-1) gives, for every vocabulary size, ties, -inf and NaN."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.engine.argmax import CHUNK, row_argmax


@settings(max_examples=200, deadline=None)
@given(rows=st.integers(1, 5), vocab=st.sampled_from([7, CHUNK, 2 * CHUNK, 2 * CHUNK + 1, 3 * CHUNK - 5, 49152]),
       values=st.lists(st.sampled_from([0.0, 1.0, 2.5, -math.inf, math.inf, math.nan]), min_size=1, max_size=8),
       seed=st.integers(0, 2**16), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_row_argmax_is_argmax(rows, vocab, values, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g).to(dtype)
    # plant the drawn values (repeats make ties, some at the chunk borders) at drawn places
    places = torch.randint(0, vocab, (rows, len(values)), generator=g)
    for i, v in enumerate(values):
        logits[torch.arange(rows), places[:, i]] = v
    logits[:, -1] = values[0]  # the last (possibly partial) chunk's end
    assert torch.equal(row_argmax(logits), logits.argmax(dim=-1))


def test_a_tie_across_chunks_gives_the_first_and_a_partial_last_chunk_is_read():
    logits = torch.zeros(3, 2 * CHUNK + 10)
    logits[0, [5, CHUNK + 3]] = 9.0                 # tie in two chunks: the first one
    logits[1, [2 * CHUNK + 9, CHUNK - 1]] = 9.0     # tie in the last partial chunk and the first
    logits[2, 2 * CHUNK + 2] = 9.0                  # alone in the partial chunk
    assert row_argmax(logits).tolist() == [5, CHUNK - 1, 2 * CHUNK + 2]
