"""Rounds of `bench peers`: every system run again, in alternating order, and the medians over the
rounds (the same requests each time; a ratio is of two runs of the same round)."""

from __future__ import annotations

import statistics
from collections.abc import Callable

from pagedserve.bench.peer_systems import SystemRun
from pagedserve.bench.report import format_table
from pagedserve.bench.throughput import ThroughputRun


def fastest_pagedserve(runs: list[SystemRun]) -> ThroughputRun:
    """The pagedserve run (one per GEMM backend) with the most output tokens/s."""
    return max((s.run for s in runs if s.run.system.startswith("pagedserve")), key=lambda r: r.output_tokens_per_s)


def run_rounds(systems: list[Callable[[], list[SystemRun]]], rounds: int) -> list[list[SystemRun]]:
    """Runs every system ``rounds`` times: round 1 in the given order, round 2 reversed, and so on
    (A B, B A, A B: a machine that speeds up or slows down during the run shifts each side alike).

    Returns:
        Per round, every system's runs in the given order.
    """
    result = []
    for r in range(rounds):
        order = list(range(len(systems)))[::1 if r % 2 == 0 else -1]
        if rounds > 1:
            print(f"round {r + 1} of {rounds}", flush=True)
        got = {i: systems[i]() for i in order}
        result.append([run for i in range(len(systems)) for run in got[i]])
    return result


def rounds_table(rounds: list[list[SystemRun]]) -> str:
    """Each system's output tokens/s per round and their median, and the best pagedserve row's ratio
    to it per round (both measured in that round) and the median of those ratios."""
    rows = []
    for i, first in enumerate(rounds[0]):
        speeds = [runs[i].run.output_tokens_per_s for runs in rounds]
        ratios = [fastest_pagedserve(runs).output_tokens_per_s / runs[i].run.output_tokens_per_s for runs in rounds]
        rows.append([first.run.system, ", ".join(f"{x:.1f}" for x in speeds), statistics.median(speeds),
                     ", ".join(f"{x:.2f}" for x in ratios), statistics.median(ratios)])
    return format_table(["system", "output tok/s by round", "median", "best pagedserve / it by round",
                         "median ratio"], rows)
