"""Issue #23: the panel GEMM (``models/csrc/panel_gemm_f32.cpp``) at a git revision against the working tree's:
the same bits? how fast? Both built for this CPU and alternated in one process (this machine's speed drifts
up to 1.5x within minutes, so only a same-process A/B resolves a 10% change).

    python scripts/panel_gemm_ab.py --base HEAD [--tree-isa avx2] [--rows 1,8,16,64,256] [--rounds 5]

The base revision's source and headers are built into the op cache under another library name
(``pagedserve_panels_base``, by ``pagedserve.bench.kernel_ab``), so both load side by side; with
``--tree-isa avx2`` the working tree's is built as it is for a CPU without AVX-512 (``__AVX512F__``
undefined: its AVX2 block) under the name ``pagedserve_panels_tree``. First every output of both is compared
bit for bit, each side packing its own panels (and the panels compared too): weights of 9 shapes (a layer
shape of the default model, widths that are not a multiple of 16, 7 panels, a depth of 1, a depth whose 257
rows take three passes), 1-257 rows, with and without a bias; the count of cases that differ is printed (a
change that should not touch the arithmetic, such as another register blocking or another instruction set,
must print 0). Then the default model's layers (fused QKV, output, fused gate-up and down of 30 layers and
the LM head, random weights, 0.54 GB: each pass from DRAM) at each ``--rows``: each side's median
milliseconds per pass over ``--rounds`` rounds (the order reversing each round), GFLOP/s, and the speed-up.
Exit status 2 when any output differs. A measurement, not a test.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from pagedserve.bench.gemm_rows import MODEL_GEMMS as MODEL_LAYERS
from pagedserve.bench.kernel_ab import files_at, files_in_tree, renamed_library
from pagedserve.engine.attention.cpu_op import kernel_defines
from pagedserve.engine.models.panel_gemm import SOURCE, panel_shape, panels_available

IDENTITY_SHAPES = ((960, 576), (576, 1536), (49, 64), (40, 601), (1, 300), (33, 1), (1536, 576), (112, 64),
                   (40, 8192))
"""(out, in) of the weights whose outputs are compared."""
IDENTITY_ROWS = (1, 2, 5, 6, 7, 11, 12, 13, 25, 64, 160, 257)


def count_differences(old, new) -> int:
    """Cases (shape, rows, bias or not) whose outputs differ in any bit."""
    differ = 0
    for n, k in IDENTITY_SHAPES:
        weight, bias = torch.randn(n, k) * k ** -0.5, torch.randn(n)
        old_panels, new_panels = torch.empty(panel_shape(n, k)), torch.empty(panel_shape(n, k))
        old.pack_panels(weight, old_panels)
        new.pack_panels(weight, new_panels)
        if not torch.equal(old_panels, new_panels):
            print(f"differ: the panels of weight [{n}, {k}]")
            differ += 1
        for m in IDENTITY_ROWS:
            x = torch.randn(m, k)
            for b in (None, bias):
                if not torch.equal(old.panel_linear(x, old_panels, b, n), new.panel_linear(x, new_panels, b, n)):
                    print(f"differ: weight [{n}, {k}], {m} rows, {'a' if b is not None else 'no'} bias")
                    differ += 1
    return differ


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True, help="the git revision to compare the working tree's GEMM with")
    p.add_argument("--rows", default="1,8,16,64,256", help="comma-separated row counts (default %(default)s)")
    p.add_argument("--rounds", type=int, default=5, help="alternating timed rounds (default %(default)s)")
    p.add_argument("--tree-isa", choices=("native", "avx2"), default="native",
                   help="build the working tree's GEMM for this CPU, or without AVX-512 (default %(default)s)")
    args = p.parse_args()
    if not panels_available():
        raise SystemExit("the working tree's GEMM cannot run here (needs AVX2, FMA and a C++ compiler)")
    new = torch.ops.pagedserve_panels
    old = renamed_library(files_at(args.base, SOURCE.parent), SOURCE, "pagedserve_panels", "base",
                          f"the GEMM at {args.base}")
    if args.tree_isa == "avx2":
        new = renamed_library(files_in_tree(SOURCE.parent), SOURCE, "pagedserve_panels", "tree",
                              "the working tree's GEMM without AVX-512",
                              "#undef __AVX512F__  // panel_gemm_ab.py --tree-isa avx2\n")
    torch.manual_seed(0)
    differ = count_differences(old, new)
    print(f"cases whose outputs differ: {differ} of {len(IDENTITY_SHAPES) * len(IDENTITY_ROWS) * 2}")
    packed = []
    for n, k in MODEL_LAYERS:
        panels = torch.empty(panel_shape(n, k))
        new.pack_panels(torch.randn(n, k) * k ** -0.5, panels)
        packed.append((panels, n, k))
    print(f"{torch.get_num_threads()} threads, defines {kernel_defines()}, {time.strftime('%H:%M UTC', time.gmtime())}")
    for m in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(m, k) for k in {k for _, k in MODEL_LAYERS}}
        times: dict[str, list[float]] = {"base": [], "tree": []}
        for i in range(args.rounds):
            for name, ops in (("base", old), ("tree", new))[::1 if i % 2 == 0 else -1]:
                start = time.perf_counter()
                for panels, n, k in packed:
                    ops.panel_linear(xs[k], panels, None, n)
                times[name].append(time.perf_counter() - start)
        base, tree = statistics.median(times["base"]), statistics.median(times["tree"])
        flops = 2 * m * sum(n * k for n, k in MODEL_LAYERS)
        print(f"{m:4d} rows: base {args.base} {base * 1e3:8.2f} ms ({flops / base / 1e9:6.1f} GFLOP/s)   working tree "
              f"{tree * 1e3:8.2f} ms ({flops / tree / 1e9:6.1f} GFLOP/s)   speed-up {base / tree:.3f}x")
    sys.exit(2 if differ else 0)


if __name__ == "__main__":
    main()
