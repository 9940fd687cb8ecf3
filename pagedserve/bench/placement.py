"""`pagedserve bench placement`: prefix-aware placement against least-loaded placement, in one run.

The workload of issue #13: ``--systems`` system prompts, each shared by ``--users`` users whose
requests (system prompt + a question of their own) arrive in random order at ``--request-rate``
requests/s (Poisson), over ``--workers`` workers of the in-process engine. Each placement serves
the same requests on a fresh engine; reported: the prefix-cache hit rate (prompt tokens read from
the cache over prompt tokens looked up), TTFT (arrival to first token: mean, p50, p99) and output
tokens/s, and the ratios prefix / least-loaded.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import numpy as np

from pagedserve.bench.machine import machine_info, machine_line

PLACEMENTS = ("least-loaded", "prefix")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("placement", help="prefix-aware vs least-loaded placement: prefix hit rate and TTFT",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="", help="model folder (default: the default model)")
    p.add_argument("--workers", type=int, default=4, help="in-process workers (default %(default)s)")
    p.add_argument("--kv-cache-memory", default="256MiB", help="KV-cache memory per worker (default %(default)s)")
    p.add_argument("--systems", type=int, default=8, help="distinct system prompts (default %(default)s)")
    p.add_argument("--users", type=int, default=32, help="users per system prompt (default %(default)s)")
    p.add_argument("--system-len", type=int, default=512, help="system prompt tokens (default %(default)s)")
    p.add_argument("--user-len", type=int, default=16, help="each user's own tokens (default %(default)s)")
    p.add_argument("--output-len", type=int, default=8, help="output tokens per request (default %(default)s)")
    p.add_argument("--request-rate", type=float, default=4.0, help="arrivals per second, Poisson (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of prompts and arrivals (default %(default)s)")
    p.add_argument("--result-json", type=Path, help="write every figure here")
    p.set_defaults(func=run)


def make_workload(args: argparse.Namespace) -> tuple[list[list[int]], list[float]]:
    """The requests' prompt token ids in arrival order, and their arrival offsets (s)."""
    rng = random.Random(args.seed)
    systems = [[rng.randrange(1000, 40000) for _ in range(args.system_len)] for _ in range(args.systems)]
    prompts = [system + [rng.randrange(1000, 40000) for _ in range(args.user_len)]
               for system in systems for _ in range(args.users)]
    rng.shuffle(prompts)
    gaps = np.random.default_rng(args.seed).exponential(1 / args.request_rate, len(prompts))
    return prompts, list(np.cumsum(gaps) - gaps[0])


def serve(llm, prompts: list[list[int]], offsets: list[float], output_len: int) -> tuple[list[float], float]:
    """Adds each prompt at its offset and steps until all finish; returns each request's TTFT (ms)
    and the output tokens/s of the run."""
    from pagedserve.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    arrived: dict[str, float] = {}
    ttfts: dict[str, float] = {}
    produced, next_index = 0, 0
    start = time.perf_counter()
    while next_index < len(prompts) or llm.has_unfinished_requests():
        now = time.perf_counter() - start
        while next_index < len(prompts) and offsets[next_index] <= now:
            arrived[llm.add_request(prompts[next_index], params)] = offsets[next_index]
            next_index += 1
        if not llm.has_unfinished_requests():
            time.sleep(min(0.01, max(0.0, offsets[next_index] - now)))
            continue
        for d in llm.step():
            produced += len(d.delta.token_ids)
            if d.delta.token_ids and d.request_id not in ttfts:
                ttfts[d.request_id] = (time.perf_counter() - start - arrived[d.request_id]) * 1000
    return list(ttfts.values()), produced / (time.perf_counter() - start)


def measure(args: argparse.Namespace, placement: str) -> dict:
    """One placement on a fresh engine of ``--workers`` workers."""
    from pagedserve.llm import LLM

    prompts, offsets = make_workload(args)
    llm = LLM(args.model or None, kv_cache_memory=args.kv_cache_memory, num_workers=args.workers,
              placement=placement)
    try:
        ttfts, tokens_per_s = serve(llm, prompts, offsets, args.output_len)
        stats = llm.stats()
    finally:
        llm.close()
    return {"hit_rate": stats.prefix_cache_hits / max(1, stats.prefix_cache_queries),
            "ttft_mean_ms": statistics.fmean(ttfts), "ttft_p50_ms": float(np.percentile(ttfts, 50)),
            "ttft_p99_ms": float(np.percentile(ttfts, 99)), "output_tokens_per_s": tokens_per_s,
            "requests": len(ttfts)}


def run(args: argparse.Namespace) -> int:
    print(f"{args.systems} system prompts x {args.users} users over {args.workers} workers, "
          f"{args.request_rate:g} req/s", flush=True)
    runs = {placement: measure(args, placement) for placement in PLACEMENTS}
    base, ours = runs["least-loaded"], runs["prefix"]
    result = {"runs": runs, "hit_rate_ratio": ours["hit_rate"] / max(1e-9, base["hit_rate"]),
              "ttft_mean_ratio": ours["ttft_mean_ms"] / base["ttft_mean_ms"],
              "machine": machine_info(), "settings": {k: str(v) for k, v in vars(args).items() if k != "func"}}
    print(f"\n{'placement':<14} {'hit rate':>9} {'TTFT mean':>10} {'p50':>8} {'p99':>8} {'out tok/s':>10}")
    for name, r in runs.items():
        print(f"{name:<14} {r['hit_rate']:>9.3f} {r['ttft_mean_ms']:>10.1f} {r['ttft_p50_ms']:>8.1f} "
              f"{r['ttft_p99_ms']:>8.1f} {r['output_tokens_per_s']:>10.1f}")
    print(f"prefix / least-loaded: hit rate x{result['hit_rate_ratio']:.2f}, mean TTFT x{result['ttft_mean_ratio']:.2f}"
          f"  ({machine_line(result['machine'])})")
    if args.result_json:
        args.result_json.write_text(json.dumps(result, indent=2) + "\n")
    return 0
