"""Mask time per decode step of `bench structured-outputs`: from the sampler's calls during engine
passes, and by replaying constrained outputs at any batch size (1, 64, 256) outside the engine.

A replay gives each of ``batch`` rows its own matcher, on the outputs of real requests (row ``r``
follows request ``r % len(outputs)``); step ``t`` times one ``mask_grammar`` call over all rows,
each matcher having consumed its request's first ``t`` tokens, then feeds every row its token
``t``. Only the mask is timed, on ``[batch, V]`` float32 logits, as the sampler calls it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

REPLAY_BATCHES = (1, 64, 256)
"""Constrained rows per step of the replays (issue #22 asks for the mask time at these)."""


@dataclass(frozen=True)
class MaskTiming:
    """``mask_grammar`` at one batch size.

    Attributes:
        batch: constrained rows per step.
        steps: steps timed at that batch.
        ms_per_step_p50, ms_per_step_mean: time in ``mask_grammar`` per step, ms.
        us_per_row: ``ms_per_step_mean`` per constrained row, microseconds.
    """

    batch: int
    steps: int
    ms_per_step_p50: float
    ms_per_step_mean: float
    us_per_row: float


def _timing(batch: int, seconds: Sequence[float]) -> MaskTiming:
    mean_ms = 1000 * statistics.fmean(seconds)
    return MaskTiming(batch, len(seconds), 1000 * statistics.median(seconds), mean_ms, 1000 * mean_ms / batch)


def mask_timing(calls: list[tuple[int, float]]) -> MaskTiming:
    """The figures of the calls at the largest batch among ``calls`` ((rows, seconds) pairs)."""
    batch = max(rows for rows, _ in calls)
    return _timing(batch, [s for rows, s in calls if rows == batch])


def replay_mask_timing(compiler, structure, outputs: Sequence[Sequence[int]], batch: int) -> MaskTiming:
    """Times ``mask_grammar`` over ``batch`` rows per step, replaying ``outputs``.

    Args:
        compiler: a ``GrammarCompiler`` of the model that generated ``outputs``.
        structure: the ``StructuredOutput`` the outputs were generated under.
        outputs: generated token ids per request (at least one; steps: the shortest's length).
        batch: rows per step.

    Raises:
        ValueError: ``outputs`` is empty or ``batch`` is below 1.
    """
    import torch

    from pagedserve.engine import grammar_matchers

    if not outputs or batch < 1:
        raise ValueError(f"replay needs at least one output and one row, got {len(outputs)} outputs, batch {batch}")
    rows = [outputs[r % len(outputs)] for r in range(batch)]
    matchers = [compiler.matcher(structure) for _ in rows]
    logits = torch.zeros(batch, compiler.vocab_size)                          # (B, V) float32
    seconds = []
    for step in range(min(map(len, outputs))):
        start = time.perf_counter()
        grammar_matchers.mask_grammar(logits, matchers)
        seconds.append(time.perf_counter() - start)
        for matcher, ids in zip(matchers, rows):
            grammar_matchers.advance(matcher, ids[step])
    return _timing(batch, seconds)


def replay_mask_timings(model, structure, outputs: Sequence[Sequence[int]],
                        batches: Sequence[int] = REPLAY_BATCHES) -> list[MaskTiming]:
    """:func:`replay_mask_timing` at each of ``batches``, with a fresh compiler of ``model`` (a
    model folder) warmed by one untimed replay at the largest batch, so the grammar's lazily built
    lexer and parser states are in place."""
    from pagedserve.engine.grammar_matchers import grammar_compiler_for

    compiler = grammar_compiler_for(model)
    replay_mask_timing(compiler, structure, outputs, max(batches))
    return [replay_mask_timing(compiler, structure, outputs, batch) for batch in batches]
