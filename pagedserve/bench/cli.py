"""`pagedserve bench`: benchmarks that measure against a baseline in the same run."""

from __future__ import annotations

import argparse


def add_bench_parser(sub: "argparse._SubParsersAction") -> None:
    """Adds `pagedserve bench ...` (its subcommands arrive with the benchmark suite)."""
    bench = sub.add_parser("bench", help="benchmarks (each compares against a baseline in the same run)",
                           description="Benchmarks: serving latency and throughput, offline throughput vs "
                           "transformers, the cost of the service split, KV utilization.")
    bench.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")
