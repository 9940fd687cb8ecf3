"""Issue #23: the panel GEMM over the default model's weights with its panels on 2 MiB pages
(``models/huge_pages.py``, as ``pack_linear_layers`` packs a model) against the same panels in torch's
ordinary allocation (4 KiB pages), alternated in one process (this machine's speed drifts up to 1.5x
within minutes, so only a same-process A/B resolves a 10% change).

    python scripts/panels_huge_pages_ab.py [--rows 1,4,16] [--rounds 15]

The layers are the default model's fused QKV, output, gate-up and down projections of 30 layers and its
LM head (0.54 GB of float32 panels, so each pass comes from DRAM), random weights. Printed per row count:
each side's median milliseconds per pass over every layer, its GB/s of weights, and the ratio; beside
them a streaming read (``torch.sum`` over 512 MiB) from each kind of page. A measurement, not a test.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from pagedserve.engine.models.huge_pages import HugePageArena
from pagedserve.engine.models.panel_gemm import PANEL_COLUMNS, panels_available

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]  # [out, in], LM head last
STREAM_ELEMENTS = 128 << 20  # 512 MiB of float32


def packed(weights: list[torch.Tensor], allocate) -> list[tuple[torch.Tensor, int]]:
    """(panels, out_features) per weight, the panels allocated by ``allocate(shape)``."""
    layers = []
    for w in weights:
        panels = allocate((-(-w.shape[0] // PANEL_COLUMNS), w.shape[1], PANEL_COLUMNS))
        torch.ops.pagedserve_panels.pack_panels(w, panels)
        layers.append((panels, w.shape[0]))
    return layers


def pass_ms(layers: list[tuple[torch.Tensor, int]], inputs: dict[int, torch.Tensor]) -> float:
    start = time.perf_counter()
    for panels, out_features in layers:
        torch.ops.pagedserve_panels.panel_linear(inputs[panels.shape[1]], panels, None, out_features)
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,4,16", help="comma-separated row counts (default 1,4,16)")
    parser.add_argument("--rounds", type=int, default=15, help="alternated rounds per row count (default 15)")
    args = parser.parse_args()
    if not panels_available():
        raise SystemExit("the panel GEMM needs an x86 CPU with AVX2 and FMA and a C++ compiler")
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(*s, generator=g) * s[1] ** -0.5 for s in SHAPES]
    arena = HugePageArena()
    sides = {"4 KiB pages": packed(weights, lambda shape: torch.empty(shape)),
             "2 MiB pages": packed(weights, lambda shape: arena.empty(shape, torch.float32))}
    nbytes = sum(p.numel() * 4 for p, _ in sides["4 KiB pages"])
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    print(f"{nbytes / 1e9:.2f} GB of panels; THP: {thp.read_text().strip() if thp.exists() else 'n/a'}")
    for rows in map(int, args.rows.split(",")):
        inputs = {k: torch.randn(rows, k, generator=g) for k in {s[1] for s in SHAPES}}
        times = {name: [] for name in sides}
        for _ in range(args.rounds):
            for name, layers in sides.items():
                times[name].append(pass_ms(layers, inputs))
        ms = {name: statistics.median(t) for name, t in times.items()}
        print(f"rows {rows}: " + ", ".join(f"{name} {m:.2f} ms ({nbytes / m / 1e6:.1f} GB/s)" for name, m in ms.items())
              + f"; 4 KiB / 2 MiB time {ms['4 KiB pages'] / ms['2 MiB pages']:.2f}x")
    buffers = {"4 KiB pages": torch.ones(STREAM_ELEMENTS), "2 MiB pages": arena.empty((STREAM_ELEMENTS,), torch.float32)}
    buffers["2 MiB pages"].fill_(1.0)
    sums = {name: [] for name in buffers}
    for _ in range(args.rounds):
        for name, buffer in buffers.items():
            start = time.perf_counter()
            buffer.sum()
            sums[name].append(time.perf_counter() - start)
    print("streaming read: " + ", ".join(f"{name} {STREAM_ELEMENTS * 4 / statistics.median(t) / 1e9:.1f} GB/s"
                                         for name, t in sums.items()))


if __name__ == "__main__":
    main()
