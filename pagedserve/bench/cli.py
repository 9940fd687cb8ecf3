"""`pagedserve bench`: benchmarks that measure against a baseline in the same run.

Each subcommand lives in its own module with ``add_parser(subparsers)``; modules import torch and
the engine only when their command runs.
"""

from __future__ import annotations

import argparse

from pagedserve.bench import (attention_op, gemm_rows, grammar_engines, kv, kv_features, long_prompt_itl, overhead, peers, pipeline_parallel, placement,
                              prefill_attention, profile, profile_workload, serve, structured_outputs, tensor_parallel, throughput,
                              token_budget)


def add_bench_parser(sub: "argparse._SubParsersAction") -> None:
    """Adds `pagedserve bench ...` to the top-level subcommands."""
    bench = sub.add_parser("bench", help="benchmarks (each compares against a baseline in the same run)",
                           description="Benchmarks: serving latency and throughput, offline throughput vs "
                           "transformers and vs vLLM CPU and llama.cpp, the cost of the service split, KV "
                           "utilization. Each prints a table and writes every figure with --result-json.")
    commands = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")
    for module in (serve, throughput, peers, overhead, kv, profile, profile_workload, token_budget,
                   long_prompt_itl, tensor_parallel, placement, pipeline_parallel, grammar_engines,
                   structured_outputs, attention_op, prefill_attention, gemm_rows):
        module.add_parser(commands)
    kv_features.add_parsers(commands)
