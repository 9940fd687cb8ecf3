"""How long a worker's step takes, and how much prefill fits beside its decodes.

Chunked prefill with decodes first (vLLM's chunked prefill; Sarathi-Serve's stall-free batching,
Agrawal et al., OSDI 2024, §4.2-4.3) caps the tokens of a step. Sarathi-Serve picks that cap
offline so that a step meets a time-between-tokens target; but a chunk's cost grows with the
context it attends over (the last 256 tokens of an 8,000-token prompt cost ~2-3x the first 256 on
a CPU), and on a CPU even the first chunk of 256 costs several decode steps. So the cap here is in
time, not tokens:

* each worker's step time is modelled as ``fixed + per_token * tokens + per_decode_row * decode_rows
  + per_pair * pairs``, where ``decode_rows`` counts the rows of sequences with one new token (and
  the drafts verified after it) and ``pairs`` the (query, key) pairs attention computes; the four
  coefficients are fitted, non-negative, to the worker's last :data:`WINDOW` observed steps with a
  prefill chunk and its last :data:`DECODE_WINDOW` without (:class:`StepCostModel`). A decode row
  costs more than a prefill token on a CPU (it reads its whole context's K/V alone, where a chunk's
  rows share theirs, and small GEMMs run slower per row): fitted to decode steps alone, 1.57 ms a
  row plus 0.96 us a context token against 1.2 ms a prefill token, on 2 Zen 4 cores for the 135M
  model; priced as a prefill token, drafts looked half as dear as they are;
* a step that runs decodes may take at most ``max_decode_slowdown`` times as long as its decodes
  alone would: the prefill chunks in it get the rest of that time, each sized from the model for
  the context it starts at (:func:`prefill_chunk_tokens`); a step without decodes is capped by
  the token budget only.

Until a worker has run a step with a prefill chunk in it, its model counts every second as
per-token (fixed and per-pair cost 0): a conservative guess that lets the first chunk beside
decodes be about as long as the decode batch, after which the fit knows better. And a fit is not
trusted far beyond the steps it was fitted to: beside decodes a chunk has at most
:data:`EXTRAPOLATION` times the tokens of the largest step in the window (a few noisy steps can
make prefill look free), so chunks grow step by step to what the fit allows.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass

WINDOW = 64
"""Steps with a prefill chunk the cost model is fitted to (the newest; older ones are forgotten)."""
DECODE_WINDOW = 32
"""Steps without a prefill chunk it is fitted to besides. Kept apart because while a long prompt
is prefilled every step has a chunk sized to take the same time: fitted to those alone, that time
could as well be all fixed cost (prefill looks free); the decode-only steps pin the fixed cost."""
EXTRAPOLATION = 2
"""A chunk beside decodes has at most this many times the tokens of the largest step fitted."""


def attention_pairs(context: int, num_new: int) -> int:
    """(query, key) pairs causal attention computes for ``num_new`` tokens after ``context`` cached ones."""
    return num_new * context + num_new * (num_new + 1) // 2


@dataclass(frozen=True)
class StepCost:
    """A step's predicted time, seconds: ``fixed_s + per_token_s * tokens + per_decode_row_s * decode_rows
    + per_pair_s * pairs``, fitted to steps of at most ``largest_step_tokens`` tokens."""

    fixed_s: float
    per_token_s: float
    per_pair_s: float
    largest_step_tokens: int
    per_decode_row_s: float = 0.0  # what a decode row costs beyond a prefill token

    def step_seconds(self, tokens: int | float, pairs: int | float, decode_rows: int | float) -> float:
        """The whole step: ``tokens`` computed, ``decode_rows`` of them rows of one-token decodes or
        their drafts, attending over ``pairs`` (query, key) pairs."""
        return self.fixed_s + self.per_token_s * tokens + self.per_decode_row_s * decode_rows + self.per_pair_s * pairs

    def chunk_seconds(self, context: int, num_new: int) -> float:
        """What a prefill chunk of ``num_new`` tokens after ``context`` cached ones adds to a step."""
        return self.per_token_s * num_new + self.per_pair_s * attention_pairs(context, num_new)


def prefill_chunk_tokens(cost: StepCost, allowance_s: float, context: int, limit: int) -> int:
    """The most tokens (at most ``limit``) a prefill chunk after ``context`` cached tokens may have
    so that it adds at most ``allowance_s`` seconds to the step (``cost.chunk_seconds``) and has at
    most ``EXTRAPOLATION * cost.largest_step_tokens`` tokens; 0 if not even one token fits. The
    chunk's cost grows with its length: a binary search finds it."""
    low, high = 0, max(0, min(limit, EXTRAPOLATION * cost.largest_step_tokens))  # low fits; high + 1 does not
    while low < high:
        middle = (low + high + 1) // 2
        if cost.chunk_seconds(context, middle) <= allowance_s:
            low = middle
        else:
            high = middle - 1
    return low


@dataclass(frozen=True)
class StepShape:
    """What a step computed: tokens, attention (query, key) pairs, and the tokens that were rows of
    one-token decodes (with the drafts verified after them); the rest were prefill chunks."""

    tokens: int
    pairs: int
    decode_rows: int

    @property
    def has_prefill(self) -> bool:
        """Whether a prefill chunk (a sequence with more than one new token) was among them."""
        return self.tokens > self.decode_rows


class StepCostModel:
    """One worker's step times, fitted as :class:`StepCost` (non-negative least squares).

    Not thread-safe: the scheduler's thread feeds and reads it.
    """

    def __init__(self) -> None:
        self._prefill_steps: deque[tuple[StepShape, float]] = deque(maxlen=WINDOW)
        self._decode_steps: deque[tuple[StepShape, float]] = deque(maxlen=DECODE_WINDOW)
        self._fit: StepCost | None = None

    def observe(self, shape: StepShape, seconds: float) -> None:
        """Adds a step that took ``seconds``; a step that computed nothing is ignored."""
        if shape.tokens > 0 and seconds > 0:
            (self._prefill_steps if shape.has_prefill else self._decode_steps).append((shape, seconds))
            self._fit = None

    def cost(self) -> StepCost | None:
        """The fitted cost; None before any step was observed."""
        steps = [*self._decode_steps, *self._prefill_steps]
        if self._fit is None and steps:
            self._fit = fit_step_cost(steps)
        return self._fit


def fit_step_cost(steps: list[tuple[StepShape, float]]) -> StepCost:
    """Non-negative least squares of ``seconds`` on ``(1, tokens, decode_rows, pairs)``: the
    unconstrained fit on each subset of the four features, the best of those that come out
    non-negative (the optimum of the constrained problem is one of them), all from one Gram matrix.
    Without a prefill among ``steps``, the conservative all-per-token model (the largest seconds per
    token seen)."""
    largest = max(shape.tokens for shape, _ in steps)
    if not any(shape.has_prefill for shape, _ in steps):
        return StepCost(0.0, max(seconds / shape.tokens for shape, seconds in steps), 0.0, largest)
    rows = [(1.0, float(shape.tokens), float(shape.decode_rows), float(shape.pairs)) for shape, _ in steps]
    targets = [seconds for _, seconds in steps]
    n = len(rows[0])
    scales = [max(abs(r[j]) for r in rows) or 1.0 for j in range(n)]  # columns scaled to [0, 1]: a sane system
    scaled = [[r[j] / scales[j] for j in range(n)] for r in rows]
    gram = [[sum(r[i] * r[j] for r in scaled) for j in range(n)] for i in range(n)]
    moments = [sum(r[i] * t for r, t in zip(scaled, targets)) for i in range(n)]
    best: tuple[float, list[float]] | None = None
    for size in range(1, n + 1):
        for subset in itertools.combinations(range(n), size):
            solution = _solve([[gram[i][j] for j in subset] for i in subset], [moments[i] for i in subset], len(rows))
            if solution is None or min(solution) < 0:
                continue
            # |A x - t|^2 = t.t - 2 x.(A^T t) + x.(A^T A) x; t.t is the same for every subset
            residual = sum(x * (sum(gram[i][j] * y for j, y in zip(subset, solution)) - 2 * moments[i])
                           for i, x in zip(subset, solution))
            if best is None or residual < best[0]:
                coefficients = [0.0] * n
                for j, x in zip(subset, solution):
                    coefficients[j] = x / scales[j]
                best = (residual, coefficients)
    assert best is not None  # the fixed-cost-only fit (the mean) is never negative
    fixed, per_token, per_decode_row, per_pair = best[1]
    return StepCost(fixed, per_token, per_pair, largest, per_decode_row)


def _solve(matrix: list[list[float]], vector: list[float], num_rows: int) -> list[float] | None:
    """``x`` with ``matrix @ x = vector`` (the normal equations of ``num_rows`` observations;
    Gauss-Jordan with partial pivoting); None when they are singular."""
    n = len(vector)
    system = [row + [v] for row, v in zip(matrix, vector)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda i: abs(system[i][col]))
        if abs(system[pivot][col]) < 1e-9 * num_rows:
            return None
        system[col], system[pivot] = system[pivot], system[col]
        for i in range(n):
            if i != col:
                factor = system[i][col] / system[col][col]
                system[i] = [a - factor * b for a, b in zip(system[i], system[col])]
    return [system[i][n] / system[i][i] for i in range(n)]
