"""`pagedserve bench token-budget`: output throughput and inter-token latency per token budget.

The token budget (``max_num_batched_tokens``) caps the tokens one step computes: decodes plus
prefill chunks (chunked prefill, Agrawal et al., 2024, "Taming Throughput-Latency Tradeoff in LLM
Inference with Sarathi-Serve", §4). A larger budget admits new prompts faster and runs bigger
GEMMs; a smaller one keeps each step short, so running requests wait less between tokens. On a
GPU the step cost hardly grows until the budget fills the device; on a CPU it grows with every
token, so the knee of the curve sits far lower.

For each budget the same requests (greedy, EOS ignored, each its own output length, as `bench
throughput` runs them) go through a fresh in-process engine, arriving as a Poisson process at
``--request-rate`` (the same seeded arrival times for every budget; ``inf``: all at once, where
every prompt is prefilled before the first decode and ITL says little). The table gives output
tokens/s, the p50/p99 inter-token latency (gaps between consecutive token deliveries of a
request, from the step outputs), mean TTFT, and throughput relative to the largest budget.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from pagedserve.config_flags import add_config_arguments, fields_except
from pagedserve.engine.runner_config import KERNELS, RunnerConfig
from pagedserve.bench.datasets import add_dataset_arguments, dataset_spec_from_args, sample_requests
from pagedserve.bench.machine import machine_info, machine_line
from pagedserve.bench.metrics import latency_stats
from pagedserve.bench.report import format_table
from pagedserve.bench.throughput import add_plans_in_flight_argument, build_engine


@dataclass(frozen=True)
class BudgetRun:
    """One budget's pass over the requests (times in milliseconds).

    Attributes:
        budget: ``max_num_batched_tokens``.
        output_tokens_per_s: output tokens over wall time.
        itl.median_ms, itl.p99_ms: inter-token latency percentiles over every gap of every request.
        ttft_mean_ms: mean time from submission to a request's first token.
    """

    budget: int
    output_tokens_per_s: float
    itl_p50_ms: float
    itl_p99_ms: float
    ttft_mean_ms: float


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("token-budget", help="throughput and inter-token latency for each token budget",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="", help="model folder (default: the default model)")
    add_dataset_arguments(p)
    p.add_argument("--budgets", default="256,512,1024,2048,4096",
                   help="comma-separated max_num_batched_tokens values (default %(default)s)")
    p.add_argument("--request-rate", type=float, default=1.0,
                   help="requests per second, Poisson arrivals; inf: all at once (default %(default)s)")
    p.add_argument("--kv-cache-memory", default="2GiB", help="engine KV-cache memory (default %(default)s)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="engine: most running sequences (default %(default)s)")
    add_config_arguments(p, RunnerConfig, exclude=fields_except(RunnerConfig, KERNELS))
    add_plans_in_flight_argument(p)
    p.add_argument("--result-json", type=Path, help="write every figure to this file")
    p.set_defaults(func=main, dtype="float32", device="cpu")


def arrival_offsets(num_requests: int, rate: float, seed: int) -> list[float]:
    """Seconds from the start at which each request arrives: a Poisson process of ``rate`` per second
    (exponential gaps, seeded); all zeros for an infinite rate."""
    import random

    if math.isinf(rate):
        return [0.0] * num_requests
    rng, t, offsets = random.Random(seed), 0.0, []
    for _ in range(num_requests):
        offsets.append(t)
        t += rng.expovariate(rate)
    return offsets


def time_budget(llm, prompts: list[list[int]], output_lens: list[int], offsets: list[float], budget: int) -> BudgetRun:
    """Feeds each prompt to ``llm`` at its arrival offset (seconds) and steps until all finish; each
    request's token delivery times give its TTFT and ITLs."""
    from pagedserve.engine.sampling_params import SamplingParams

    start = time.perf_counter()
    arrived: dict[str, float] = {}
    times: dict[str, list[float]] = {}
    pending = 0
    while pending < len(prompts) or llm.has_unfinished_requests():
        now = time.perf_counter()
        while pending < len(prompts) and start + offsets[pending] <= now:
            params = SamplingParams(max_tokens=output_lens[pending], temperature=0.0, ignore_eos=True)
            request_id = llm.add_request(prompts[pending], params)
            arrived[request_id], times[request_id] = start + offsets[pending], []
            pending += 1
        if not llm.has_unfinished_requests():
            time.sleep(min(0.01, max(0.0, start + offsets[pending] - now)))
            continue
        steps = llm.step()
        now = time.perf_counter()
        for item in steps:
            times[item.request_id] += [now] * len(item.delta.token_ids)
    elapsed = time.perf_counter() - start
    itl = latency_stats(b - a for t in times.values() for a, b in zip(t, t[1:]))
    ttft = sum(t[0] - arrived[r] for r, t in times.items()) / len(times)
    return BudgetRun(budget, sum(output_lens) / elapsed, itl.median_ms, itl.p99_ms, 1000 * ttft)


def main(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from pagedserve.model_files import resolve_model

    model = resolve_model(args.model or None)
    tokenizer = AutoTokenizer.from_pretrained(model)
    requests = sample_requests(dataset_spec_from_args(args), tokenizer)
    prompts = [tokenizer.encode(r.prompt) for r in requests]
    output_lens = [r.expected_output_len for r in requests]
    offsets = arrival_offsets(len(prompts), args.request_rate, args.seed)
    runs = []
    for budget in [int(b) for b in args.budgets.split(",")]:
        args.max_num_batched_tokens = budget
        print(f"budget {budget}: {len(prompts)} requests ...", flush=True)
        runs.append(time_budget(build_engine(model, args), prompts, output_lens, offsets, budget))
    best = max(runs, key=lambda r: r.budget)
    print(f"\nToken budget sweep, {len(prompts)} requests at {args.request_rate:g} req/s, gemm backend {args.gemm_backend}, {args.compile_mode} "
          f"({machine_line(machine_info())})")
    print(format_table(["budget", "output tok/s", "vs largest", "ITL p50 ms", "ITL p99 ms", "TTFT mean ms"],
                       [[r.budget, r.output_tokens_per_s, f"{r.output_tokens_per_s / best.output_tokens_per_s:.3f}",
                         r.itl_p50_ms, r.itl_p99_ms, r.ttft_mean_ms] for r in runs]))
    if args.result_json:
        args.result_json.write_text(json.dumps({"runs": [asdict(r) for r in runs], "gemm_backend": args.gemm_backend, "compile_mode": args.compile_mode,
                                                "num_prompts": len(prompts), "request_rate": args.request_rate, "machine": machine_info()}, indent=2))
    return 0
