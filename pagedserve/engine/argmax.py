"""Greedy token choice: each row's first maximum, as ``torch.argmax(dim=-1)`` returns it, in two
vectorised passes.

On CPU ``argmax`` over a row is a scalar loop: 3.8 ms for 48 rows of the default model's 49,152
logits on the 2-core Xeon, where ``amax`` takes 0.3 ms. :func:`row_argmax` takes each chunk's
maximum with ``amax``, picks the first chunk holding the row's maximum, and runs ``argmax`` inside
that chunk only: 0.5 ms for the same rows (0.06 ms for one row), and the same index, ties and NaN
included (a NaN is every reduction's maximum, so the first NaN is found as ``argmax`` finds it).
"""

from __future__ import annotations

import torch

CHUNK = 1024
"""Logits per chunk: the first pass reads every logit once, the second ``CHUNK`` per row."""


def row_argmax(logits: torch.Tensor) -> torch.Tensor:
    """Index of each row's first maximum: int64 ``[N]`` for ``logits`` ``[N, V]`` (any float dtype,
    any device), equal to ``logits.argmax(dim=-1)``.

    The first chunk holding the row maximum contains its first occurrence. A vocabulary that is
    not a multiple of :data:`CHUNK` ends with a shorter chunk, read through a window of the last
    ``CHUNK`` logits: the part of the window before that chunk holds no maximum (an earlier chunk
    would have been picked), so the window's first maximum is the row's.
    """
    rows, vocab = logits.shape
    if vocab < 2 * CHUNK:
        return logits.argmax(dim=-1)
    whole = vocab // CHUNK * CHUNK
    maxima = logits[:, :whole].unflatten(1, (-1, CHUNK)).amax(dim=-1)             # (N, V // CHUNK)
    if whole < vocab:
        maxima = torch.cat((maxima, logits[:, whole:].amax(dim=-1, keepdim=True)), dim=1)  # (N, chunks)
    start = (maxima.argmax(dim=-1) * CHUNK).clamp_(max=vocab - CHUNK)             # (N,) first logit read
    window = logits.gather(1, start[:, None] + torch.arange(CHUNK, device=logits.device))  # (N, CHUNK)
    return start + window.argmax(dim=-1)                                           # (N,)
