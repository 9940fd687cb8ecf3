"""`pagedserve bench gemm-rows`: the model's linear layers at some row counts, pagedserve's kernel vs oneDNN.

A decode step of a few sequences (and every batch-1 step) multiplies a few rows by every weight of
the model, so its GEMMs are bound by reading the weights: the figure of merit there is GB/s = weight
bytes / time; from tens of rows up they are bound by the multiply-adds (GFLOP/s, also shown). For each
row count of ``--rows``, the default model's linear layers (fused QKV, output projection, gate-up and
down of each of ``--layers`` layers, then the LM head; random weights of ``--dtype``) run through
oneDNN's packed GEMM (``--gemm-backend onednn``, one row padded to ``MIN_ROWS``) and through
pagedserve's kernel for that dtype, in alternating rounds: bfloat16, the few-row kernel
(``models/csrc/few_rows_bf16.cpp``, which the layers take up to ``onednn.few_rows()`` rows; needs AVX512_BF16);
float32, the panel GEMM (``models/csrc/panel_gemm_f32.cpp``, ``--gemm-backend panels``; needs AVX2 and
FMA). Beside them, in the same run, the streaming read (``streaming_read``: ``torch.sum`` over 512 MiB on 2
MiB pages, as the packed weights).
Medians of ``--rounds`` rounds.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from pagedserve.bench.attention_op import median_ms
from pagedserve.bench.streaming_read import STREAM_BYTES, Pages, read_buffer
from pagedserve.bench.machine import machine_info, machine_line
from pagedserve.bench.report import format_table

LAYER_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # [out, in] of one default-model layer
LM_HEAD = (49152, 576)
NUM_LAYERS = 30
MODEL_GEMMS = (*LAYER_SHAPES * NUM_LAYERS, LM_HEAD)
"""The default model's linear layers, [out, in]: fused QKV, output, fused gate-up and down of each layer; the LM head."""
KERNELS = {"bfloat16": "few-row", "float32": "panels"}  # --dtype -> pagedserve's kernel for it


@dataclass(frozen=True)
class RowsTiming:
    """All the layers' GEMMs at one row count.

    Attributes:
        rows: rows of the activations (tokens of the step).
        onednn_ms, kernel_ms: median time of one pass over every layer (oneDNN, pagedserve's kernel), milliseconds.
        onednn_gbps, kernel_gbps: weight bytes over that time, 10^9 bytes per second.
        onednn_gflops, kernel_gflops: 2 x rows x weight elements over that time, 10^9 per second.
    """

    rows: int
    onednn_ms: float
    kernel_ms: float
    onednn_gbps: float
    kernel_gbps: float
    onednn_gflops: float
    kernel_gflops: float


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("gemm-rows", help="the model's GEMMs at some row counts: pagedserve's kernel vs oneDNN",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,2,4,8,12,16", help="comma-separated row counts (default %(default)s)")
    p.add_argument("--dtype", choices=KERNELS, default="bfloat16",
                   help="weights and activations: bfloat16 (the few-row kernel) or float32 (the panel GEMM) "
                        "(default %(default)s)")
    p.add_argument("--layers", type=int, default=NUM_LAYERS, help="decoder layers of the default model's shapes (default %(default)s)")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds per kernel and row count (default %(default)s)")
    p.add_argument("--result-json", type=Path, help="write every figure here")
    p.set_defaults(func=run)


def measure(args: argparse.Namespace) -> tuple[float, list[RowsTiming]]:
    """The streaming read's GB/s and a :class:`RowsTiming` per row count.

    Raises:
        RuntimeError: the kernel for ``--dtype`` is not available here (no AVX512_BF16, or no AVX2 and
            FMA, or no compiler).
    """
    import torch

    from pagedserve.engine.models.onednn import MIN_ROWS, OneDnnLinear, few_rows_available
    from pagedserve.engine.models.huge_pages import HugePageArena
    from pagedserve.engine.models.panel_gemm import PanelLinear, panels_available

    dtype = getattr(torch, args.dtype)
    if not (few_rows_available() if dtype == torch.bfloat16 else panels_available()):
        raise RuntimeError(f"the {KERNELS[args.dtype]} kernel needs a CPU with "
                           f"{'AVX512_BF16' if dtype == torch.bfloat16 else 'AVX2 and FMA'} and a C++ compiler")
    g = torch.Generator().manual_seed(0)
    shapes = [*LAYER_SHAPES * args.layers, LM_HEAD]
    weights = [(torch.randn(*s, generator=g) * s[1] ** -0.5).to(dtype) for s in shapes]
    layers = [OneDnnLinear(w, None) for w in weights]
    if dtype == torch.float32:  # pagedserve's kernel for the dtype, as a call per layer
        arena = HugePageArena()  # as pack_linear_layers packs a model's
        kernel_layers = [PanelLinear(w, None, arena) for w in weights]
    else:
        kernel_layers = [functools.partial(torch.ops.pagedserve_gemm.few_rows_linear, packed=layer.pairs, bias=None)
                         for layer in layers]
    elements = sum(o * i for o, i in shapes)
    weight_bytes = elements * weights[0].element_size()
    inputs = {i: torch.randn(max(map(int, args.rows.split(","))) + MIN_ROWS, i, generator=g).to(dtype)
              for i in {s[1] for s in shapes}}
    buffer = read_buffer(Pages.HUGE)  # as the packed weights
    stream_gbps = STREAM_BYTES / median_ms(lambda i: buffer.sum(), 1, args.rounds) / 1e6

    def onednn(rows: int) -> None:
        for layer, (_, i) in zip(layers, shapes):
            torch.ops.mkldnn._linear_pointwise(inputs[i][:max(rows, MIN_ROWS)], layer.packed_weight, None, "none", [], "")

    def kernel(rows: int) -> None:
        for layer, (_, i) in zip(kernel_layers, shapes):
            layer(inputs[i][:rows])

    timings = []
    for rows in map(int, args.rows.split(",")):
        ms = {onednn: [], kernel: []}
        onednn(rows), kernel(rows)  # warm-up
        for r in range(args.rounds):  # alternate, so drift hits both
            for run_kernel in (onednn, kernel) if r % 2 == 0 else (kernel, onednn):
                start = time.perf_counter()
                run_kernel(rows)
                ms[run_kernel].append((time.perf_counter() - start) * 1e3)
        a, b = statistics.median(ms[onednn]), statistics.median(ms[kernel])
        timings.append(RowsTiming(rows, a, b, weight_bytes / a / 1e6, weight_bytes / b / 1e6,
                                  2 * rows * elements / a / 1e6, 2 * rows * elements / b / 1e6))
    return stream_gbps, timings


def run(args: argparse.Namespace) -> int:
    import torch

    from pagedserve.engine.models.onednn import few_rows

    stream_gbps, timings = measure(args)
    name = KERNELS[args.dtype]
    title = (f"{args.dtype} GEMMs of {args.layers} default-model layers + LM head, {torch.get_num_threads()} threads"
             + (f" (the layers take the few-row kernel up to {few_rows()} rows)" if args.dtype == "bfloat16" else ""))
    rows = [(t.rows, t.onednn_ms, t.onednn_gbps, t.onednn_gflops, t.kernel_ms, t.kernel_gbps, t.kernel_gflops,
             t.onednn_ms / t.kernel_ms) for t in timings]
    print(format_table(("rows", "oneDNN ms", "oneDNN GB/s", "oneDNN GFLOP/s", f"{name} ms", f"{name} GB/s",
                        f"{name} GFLOP/s", f"oneDNN / {name} time"), rows, title))
    print(f"streaming read (float32 sum, 2 MiB pages): {stream_gbps:.1f} GB/s")
    info = machine_info()
    print(machine_line(info))
    if args.result_json:
        args.result_json.write_text(json.dumps({"stream_gbps": stream_gbps, "timings": [asdict(t) for t in timings],
                                                "kernel": name, "few_rows": few_rows(),
                                                "threads": torch.get_num_threads(),
                                                "settings": {k: str(v) for k, v in vars(args).items() if k != "func"},
                                                "machine": info}, indent=2) + "\n")
    return 0
