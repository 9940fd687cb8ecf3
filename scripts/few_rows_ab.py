"""Issue #23: the few-row bfloat16 GEMM (``models/csrc/few_rows_bf16.cpp``) at a git revision against the
working tree's: the same bits? how fast? Both built for this CPU with its kernel defines
(``cpu_op.kernel_defines``) and alternated in one process (this VM's memory bandwidth moves 30-45 GB/s
within minutes, so only a same-process A/B resolves a 10% change).

    python scripts/few_rows_ab.py --base HEAD [--rows 1,4,8,64,256] [--rounds 9]

The base revision's source and headers are built under another library name (``pagedserve_gemm_base``, by
``pagedserve.bench.kernel_ab``), so both load side by side. The default model's layers (fused QKV, output,
fused gate-up and down of 30 layers and the LM head, random bfloat16 weights, 0.27 GB: each pass from DRAM)
run at each ``--rows``: first every layer's outputs of both are compared bit for bit, then each side's median
milliseconds per pass over ``--rounds`` rounds (the order reversing each round), its GB/s of weights read,
and the speed-up. Exit status 2 when any output differs. A measurement, not a test.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from pagedserve.bench.gemm_rows import MODEL_GEMMS as MODEL_LAYERS
from pagedserve.bench.kernel_ab import files_at, renamed_library
from pagedserve.engine.attention.cpu_op import kernel_defines
from pagedserve.engine.models.onednn import FEW_ROWS_SOURCE, few_rows_available


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True, help="the git revision to compare the working tree's kernel with")
    p.add_argument("--rows", default="1,4,8,64,256", help="comma-separated row counts (default %(default)s)")
    p.add_argument("--rounds", type=int, default=9, help="alternating timed rounds (default %(default)s)")
    args = p.parse_args()
    if not few_rows_available():
        raise SystemExit("the working tree's kernel cannot run here (needs AVX512_BF16 and a C++ compiler)")
    new = torch.ops.pagedserve_gemm
    old = renamed_library(files_at(args.base, FEW_ROWS_SOURCE.parent), FEW_ROWS_SOURCE, "pagedserve_gemm", "base",
                          f"the kernel at {args.base}")
    torch.manual_seed(0)
    layers = [new.pack_pairs((torch.randn(n, k) * k ** -0.5).to(torch.bfloat16)) for n, k in MODEL_LAYERS]
    weight_bytes = sum(n * k * 2 for n, k in MODEL_LAYERS)
    print(f"{torch.get_num_threads()} threads, defines {kernel_defines()}, {time.strftime('%H:%M UTC', time.gmtime())}")
    differ = 0
    for m in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(m, k).to(torch.bfloat16) for k in {k for _, k in MODEL_LAYERS}}
        differ += sum(not torch.equal(old.few_rows_linear(xs[w.shape[1] * 2], w, None),
                                      new.few_rows_linear(xs[w.shape[1] * 2], w, None)) for w in layers)
        times: dict[str, list[float]] = {"base": [], "tree": []}
        for i in range(args.rounds):
            for name, ops in (("base", old), ("tree", new))[::1 if i % 2 == 0 else -1]:
                start = time.perf_counter()
                for w in layers:
                    ops.few_rows_linear(xs[w.shape[1] * 2], w, None)
                times[name].append(time.perf_counter() - start)
        base, tree = statistics.median(times["base"]), statistics.median(times["tree"])
        print(f"{m:4d} rows: base {args.base} {base * 1e3:7.2f} ms ({weight_bytes / base / 1e9:5.1f} GB/s)   working "
              f"tree {tree * 1e3:7.2f} ms ({weight_bytes / tree / 1e9:5.1f} GB/s)   speed-up {base / tree:.3f}x")
    print(f"layers whose outputs differ: {differ}")
    sys.exit(2 if differ else 0)


if __name__ == "__main__":
    main()
