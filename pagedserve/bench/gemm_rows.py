"""`pagedserve bench gemm-rows`: the model's linear layers at a few rows, bfloat16 few-row kernel vs oneDNN.

A decode step of a few sequences (and every batch-1 step) multiplies a few rows by every weight of
the model, so its GEMMs are bound by reading the weights: the figure of merit is GB/s = weight bytes
/ time. For each row count of ``--rows``, the default model's linear layers (fused QKV, output
projection, gate-up and down of each of ``--layers`` layers, then the LM head; random bfloat16
weights) run through oneDNN's packed GEMM (as ``--gemm-backend onednn`` runs rows past
``FEW_ROWS``) and through the few-row kernel (``models/csrc/few_rows_bf16.cpp``, which the layers
take up to ``FEW_ROWS`` rows), in alternating rounds; beside them, in the same run, a streaming
read (``torch.sum`` over a 512 MiB float32 buffer). Medians of ``--rounds`` rounds. Needs AVX512_BF16.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from pagedserve.bench.attention_op import STREAM_BYTES, median_ms
from pagedserve.bench.machine import machine_info, machine_line
from pagedserve.bench.report import format_table

LAYER_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # [out, in] of one default-model layer
LM_HEAD = (49152, 576)


@dataclass(frozen=True)
class RowsTiming:
    """All the layers' GEMMs at one row count.

    Attributes:
        rows: rows of the activations (tokens of the step).
        onednn_ms, few_rows_ms: median time of one pass over every layer, milliseconds.
        onednn_gbps, few_rows_gbps: weight bytes over that time, 10^9 bytes per second.
    """

    rows: int
    onednn_ms: float
    few_rows_ms: float
    onednn_gbps: float
    few_rows_gbps: float


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("gemm-rows", help="the model's bfloat16 GEMMs at a few rows: few-row kernel vs oneDNN, GB/s",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,2,4,8,12,16", help="comma-separated row counts (default %(default)s)")
    p.add_argument("--layers", type=int, default=30, help="decoder layers of the default model's shapes (default %(default)s)")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds per kernel and row count (default %(default)s)")
    p.add_argument("--result-json", type=Path, help="write every figure here")
    p.set_defaults(func=run)


def measure(args: argparse.Namespace) -> tuple[float, list[RowsTiming]]:
    """The streaming read's GB/s and a :class:`RowsTiming` per row count.

    Raises:
        RuntimeError: the few-row kernel is not available here (no AVX512_BF16, or no compiler).
    """
    import torch

    from pagedserve.engine.models.onednn import MIN_ROWS, OneDnnLinear, few_rows_available

    if not few_rows_available():
        raise RuntimeError("the few-row bfloat16 kernel needs a CPU with AVX512_BF16 and a C++ compiler")
    g = torch.Generator().manual_seed(0)
    shapes = [*LAYER_SHAPES * args.layers, LM_HEAD]
    layers = [OneDnnLinear((torch.randn(*s, generator=g) * s[1] ** -0.5).bfloat16(), None) for s in shapes]
    weight_bytes = sum(2 * o * i for o, i in shapes)
    inputs = {i: torch.randn(max(map(int, args.rows.split(","))) + MIN_ROWS, i, generator=g).bfloat16()
              for i in {s[1] for s in shapes}}
    buffer = torch.ones(STREAM_BYTES // 4)
    stream_gbps = STREAM_BYTES / median_ms(lambda i: buffer.sum(), 1, args.rounds) / 1e6

    def onednn(rows: int) -> None:
        for layer, (_, i) in zip(layers, shapes):
            torch.ops.mkldnn._linear_pointwise(inputs[i][:max(rows, MIN_ROWS)], layer.packed_weight, None, "none", [], "")

    def few_rows(rows: int) -> None:
        for layer, (_, i) in zip(layers, shapes):
            torch.ops.pagedserve_gemm.few_rows_linear(inputs[i][:rows], layer.pairs, None)

    timings = []
    for rows in map(int, args.rows.split(",")):
        ms = {onednn: [], few_rows: []}
        onednn(rows), few_rows(rows)  # warm-up
        for r in range(args.rounds):  # alternate, so drift hits both
            for kernel in (onednn, few_rows) if r % 2 == 0 else (few_rows, onednn):
                start = time.perf_counter()
                kernel(rows)
                ms[kernel].append((time.perf_counter() - start) * 1e3)
        a, b = statistics.median(ms[onednn]), statistics.median(ms[few_rows])
        timings.append(RowsTiming(rows, a, b, weight_bytes / a / 1e6, weight_bytes / b / 1e6))
    return stream_gbps, timings


def run(args: argparse.Namespace) -> int:
    import torch

    from pagedserve.engine.models.onednn import FEW_ROWS

    stream_gbps, timings = measure(args)
    title = (f"bfloat16 GEMMs of {args.layers} default-model layers + LM head, {torch.get_num_threads()} threads "
             f"(the layers take the few-row kernel up to {FEW_ROWS} rows)")
    rows = [(t.rows, t.onednn_ms, t.onednn_gbps, t.few_rows_ms, t.few_rows_gbps, t.onednn_ms / t.few_rows_ms)
            for t in timings]
    print(format_table(("rows", "oneDNN ms", "oneDNN GB/s", "few-row ms", "few-row GB/s", "oneDNN / few-row time"),
                       rows, title))
    print(f"streaming read (float32 sum): {stream_gbps:.1f} GB/s")
    info = machine_info()
    print(machine_line(info))
    if args.result_json:
        args.result_json.write_text(json.dumps({"stream_gbps": stream_gbps, "timings": [asdict(t) for t in timings],
                                                "few_rows": FEW_ROWS, "threads": torch.get_num_threads(),
                                                "settings": {k: str(v) for k, v in vars(args).items() if k != "func"},
                                                "machine": info}, indent=2) + "\n")
    return 0
