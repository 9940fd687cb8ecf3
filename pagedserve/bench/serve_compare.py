"""`bench serve` with several backends: the same requests through each API, compared in one table."""

from __future__ import annotations

import argparse
import math
import statistics
from collections.abc import Sequence

from pagedserve.bench.load_senders import Backend


def parse_backends(text: str) -> tuple[Backend, ...]:
    """``"grpc,openai"`` -> ``(Backend.GRPC, Backend.OPENAI)``. Raises ``argparse.ArgumentTypeError``
    on an unknown or repeated name."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    try:
        backends = tuple(Backend(name) for name in names)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"backends are grpc and openai, got {text!r}") from exc
    if not backends or len(set(backends)) != len(backends):
        raise argparse.ArgumentTypeError(f"name each backend once, got {text!r}")
    return backends


def format_backend_comparison(results: Sequence) -> str:
    """Per request rate and backend: output tok/s and mean TTFT/TPOT (medians over the rounds), and
    each against the first backend (throughput ratio, TTFT difference in ms).

    Args:
        results: ``serve.RunResult`` values of one run, every backend at every rate.
    """
    from pagedserve.bench.report import format_table

    rows = []
    for rate in dict.fromkeys(r.load.request_rate for r in results):
        at_rate = [r for r in results if r.load.request_rate == rate]
        figures = {}
        for backend in dict.fromkeys(r.backend for r in at_rate):
            runs = [r for r in at_rate if r.backend is backend]
            figures[backend] = (statistics.median(r.metrics.output_throughput for r in runs),
                                statistics.median(r.metrics.ttft.mean_ms for r in runs),
                                statistics.median(r.metrics.tpot.mean_ms for r in runs), len(runs))
        base = next(iter(figures.values()))
        for backend, (tps, ttft, tpot, rounds) in figures.items():
            rows.append(["inf" if math.isinf(rate) else f"{rate:g}", backend.value, rounds, tps, ttft, tpot,
                         f"x{tps / base[0]:.3f}" if base[0] else "-", f"{ttft - base[1]:+.1f}"])
    headers = ["rate (req/s)", "backend", "rounds", "out tok/s", "mean TTFT", "mean TPOT", "tok/s vs first",
               "TTFT vs first (ms)"]
    return format_table(headers, rows, title=" The same requests through each API (medians over rounds; ms) ")
