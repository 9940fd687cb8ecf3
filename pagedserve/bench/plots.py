"""PNG plots for `pagedserve bench serve` (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from pagedserve.bench.metrics import RequestRecord

# name in file and title -> the per-request samples, in s
_LATENCIES: dict[str, Callable[[RequestRecord], list[float]]] = {
    "ttft": lambda r: [r.ttft_s],
    "tpot": lambda r: [] if r.tpot_s is None else [r.tpot_s],
    "itl": lambda r: r.itls_s,
    "e2el": lambda r: [r.e2el_s],
}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def latency_samples_ms(records: Sequence[RequestRecord], name: str) -> list[float]:
    """The sorted samples (ms) of latency ``name`` (ttft, tpot, itl, e2el) over the successful records."""
    pick = _LATENCIES[name]
    return sorted(v * 1000.0 for r in records if r.success for v in pick(r))


def plot_latency_cdfs(runs: Sequence[tuple[str, Sequence[RequestRecord]]], out_dir: Path) -> list[Path]:
    """One CDF plot per latency (``ttft_cdf.png`` ...), one curve per run.

    Args:
        runs: ``(label, records)`` per run, e.g. ``("rate inf", records)``.
        out_dir: folder for the PNGs (created).

    Returns:
        The written files.
    """
    plt = _pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name in _LATENCIES:
        fig, ax = plt.subplots(figsize=(6, 4))
        for label, records in runs:
            samples = latency_samples_ms(records, name)
            if samples:
                fractions = [(i + 1) / len(samples) for i in range(len(samples))]
                ax.step(samples, fractions, where="post", label=f"{label} (n={len(samples)})")
        ax.set_xlabel(f"{name.upper()} (ms)")
        ax.set_ylabel("fraction of samples ≤ x")
        ax.set_ylim(0, 1.02)
        ax.set_title(f"{name.upper()} CDF")
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
        path = out_dir / f"{name}_cdf.png"
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written


def plot_throughput_vs_rate(rates: Sequence[float], output_throughputs: Sequence[float], out_dir: Path) -> Path:
    """Output throughput (tok/s) against the offered request rate (req/s), ``throughput_vs_rate.png``.

    Rates are placed evenly (so ``inf`` fits) and labelled with their values.
    """
    plt = _pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 4))
    positions = list(range(len(rates)))
    ax.plot(positions, output_throughputs, marker="o")
    ax.set_xticks(positions, [_rate_label(r) for r in rates])
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("output throughput (tok/s)")
    ax.set_title("Output throughput vs request rate")
    ax.set_ylim(0, 1.1 * max(output_throughputs, default=0.0) or 1.0)
    ax.grid(True, alpha=0.3)
    path = out_dir / "throughput_vs_rate.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _rate_label(rate: float) -> str:
    return "inf" if rate == float("inf") else f"{rate:g}"
