"""Issue #23's check: are a GEMM's rows the same computed alone as inside a batch?

For each linear layer shape of a model (default: SmolLM2-135M's five, ``[out, in]``) and each
path, ``F.linear`` (MKL, ``--gemm-backend torch``) and pagedserve's oneDNN layer
(``--gemm-backend onednn``/``auto``, single rows padded to two), computes a batch of
``--rows`` random rows, then 17 of its rows again inside sub-batches of 1, 2, 7 and 64 rows, and
counts the rows whose result differs in any bit. Also prints each path's relative error against
float64 (max |y - y64| / max |y64|) and the time of a 1-row and a 2-row product.

    python scripts/gemm_batch_invariance.py [--rows 257] [--dtype float32|bfloat16]

Prints one line per shape and path; exits 0 (a measurement, not a test: the counts depend on the
CPU and the torch build; tests/worker/test_onednn_linear.py asserts the oneDNN path's).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from pagedserve.engine.models.onednn import OneDnnLinear

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576))
"""SmolLM2-135M's GEMMs ``[out, in]``: fused QKV, output projection, fused gate-up, down, LM head."""

SUB_BATCHES = (1, 2, 7, 64)
CHECKED_ROWS = 17


def differing_rows(f, x: torch.Tensor, sub_batch: int) -> int:
    """Of ``CHECKED_ROWS`` rows spread over ``x``, how many differ computed inside a ``sub_batch`` of
    neighbouring rows from inside the whole of ``x``."""
    full = f(x)
    step = max(1, x.shape[0] // CHECKED_ROWS)
    count = 0
    for row in range(0, step * CHECKED_ROWS, step):
        start = min(row, x.shape[0] - sub_batch)
        count += not torch.equal(f(x[start:start + sub_batch])[row - start], full[row])
    return count


def micros(f, x: torch.Tensor, repeats: int = 50) -> float:
    """Mean microseconds of ``f(x)`` after three warm-up calls."""
    for _ in range(3):
        f(x)
    start = time.perf_counter()
    for _ in range(repeats):
        f(x)
    return (time.perf_counter() - start) / repeats * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=257, help="rows of the whole batch")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}, "
          f"{CHECKED_ROWS} rows checked in sub-batches of {SUB_BATCHES} vs in {args.rows}")
    for out_features, in_features in SHAPES:
        weight = (torch.randn(out_features, in_features, generator=g) * in_features ** -0.5)
        x = torch.randn(args.rows, in_features, generator=g)
        exact = x.double() @ weight.double().T
        weight, x = weight.to(dtype), x.to(dtype)
        layer = OneDnnLinear(weight, None)
        for name, f in (("F.linear", lambda a: F.linear(a, weight)), ("onednn", layer)):
            counts = " ".join(f"{b}:{differing_rows(f, x, b):2d}" for b in SUB_BATCHES)
            error = float((f(x).double() - exact).abs().max() / exact.abs().max())
            print(f"[{out_features:5d}, {in_features:4d}] {name:8s} differing rows by sub-batch {counts}  "
                  f"rel. error {error:.1e}  1 row {micros(f, x[:1]):7.0f} us  2 rows {micros(f, x[:2]):7.0f} us")


if __name__ == "__main__":
    main()
