"""Benchmarks of the KV-memory features, each against the same engine without the feature, in one run.

* ``bench prefix-cache``: TTFT of requests whose 1,000-token prefix is cached vs uncached.
* ``bench parallel-sampling``: peak KV blocks of one n=4 request vs four independent requests.
* ``bench chunked-prefill``: p99 inter-token latency of decoding requests while long prompts
  arrive, and output throughput, with and without chunked prefill.
All run the in-process engine on the default model (or ``--model``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import time
from pathlib import Path

import numpy as np

from pagedserve.bench.in_process import ttft_ms
from pagedserve.bench.machine import machine_info, machine_line


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="", help="model folder (default: the default model)")
    p.add_argument("--kv-cache-memory", default="1GiB", help="KV-cache memory (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts (default %(default)s)")
    p.add_argument("--result-json", type=Path, help="write every figure here")


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Adds the three feature benchmarks."""
    p = sub.add_parser("prefix-cache", help="TTFT with a cached 1,000-token prefix vs uncached",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _common(p)
    p.add_argument("--prefix-len", type=int, default=1000, help="shared prefix tokens (default %(default)s)")
    p.add_argument("--suffix-len", type=int, default=16, help="own tokens per request (default %(default)s)")
    p.add_argument("--requests", type=int, default=8, help="requests timed each way (default %(default)s)")
    p.set_defaults(func=run_prefix_cache)

    p = sub.add_parser("parallel-sampling", help="KV memory of n=4 sampling vs four independent requests",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _common(p)
    p.add_argument("--prompt-len", type=int, default=500, help="prompt tokens (default %(default)s)")
    p.add_argument("--output-len", type=int, default=100, help="tokens per sample (default %(default)s)")
    p.add_argument("--n", type=int, default=4, help="samples (default %(default)s)")
    p.set_defaults(func=run_parallel_sampling)

    p = sub.add_parser("chunked-prefill", help="p99 ITL and throughput with vs without chunked prefill",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _common(p)
    p.add_argument("--decoders", type=int, default=8, help="requests decoding throughout (default %(default)s)")
    p.add_argument("--decode-len", type=int, default=96, help="their output tokens (default %(default)s)")
    p.add_argument("--long-prompts", type=int, default=4, help="long prompts arriving (default %(default)s)")
    p.add_argument("--long-len", type=int, default=1500, help="their length in tokens (default %(default)s)")
    p.add_argument("--budget", type=int, default=256,
                   help="max_num_batched_tokens with chunking; without, it is the long length (default %(default)s)")
    p.set_defaults(func=run_chunked_prefill)


def _llm(args: argparse.Namespace, **options):
    from pagedserve.llm import LLM

    return LLM(args.model or None, kv_cache_memory=args.kv_cache_memory, **options)


def _random_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 40000) for _ in range(n)]


def _write(args: argparse.Namespace, result: dict) -> None:
    result["machine"] = machine_info()
    result["settings"] = {k: str(v) for k, v in vars(args).items() if k != "func"}
    print(f"({machine_line(result['machine'])})")
    if args.result_json:
        args.result_json.write_text(json.dumps(result, indent=2) + "\n")


def run_prefix_cache(args: argparse.Namespace) -> int:
    rng = random.Random(args.seed)
    prefix = _random_ids(rng, args.prefix_len)
    prompts = [prefix + _random_ids(rng, args.suffix_len) for _ in range(args.requests)]
    uncached_llm = _llm(args, enable_prefix_caching=False)
    cached_llm = _llm(args)
    ttft_ms(uncached_llm, _random_ids(rng, 64))  # warm-up
    ttft_ms(cached_llm, prefix + _random_ids(rng, args.suffix_len))  # warm-up that also caches the prefix
    uncached = [ttft_ms(uncached_llm, p) for p in prompts]
    cached = [ttft_ms(cached_llm, p) for p in prompts]
    ratio = statistics.median(cached) / statistics.median(uncached)
    print(f"\nPrefix caching: TTFT of a {args.prefix_len}+{args.suffix_len}-token prompt, median of {args.requests}")
    print(f"{'uncached ms':>12} {'cached ms':>10} {'cached/uncached':>16}")
    print(f"{statistics.median(uncached):>12.1f} {statistics.median(cached):>10.1f} {ratio:>16.3f}")
    stats = cached_llm.stats()
    _write(args, {"ttft_ratio": ratio, "uncached_ttft_ms": uncached, "cached_ttft_ms": cached,
                  "prefix_cache_hits": stats.prefix_cache_hits, "prefix_cache_queries": stats.prefix_cache_queries})
    return 0


def _peak_blocks(llm, prompts_and_params) -> int:
    """Peak KV blocks in use while the requests run."""
    for prompt, params in prompts_and_params:
        llm.add_request(prompt, params)
    peak = 0
    while llm.has_unfinished_requests():
        llm.step()
        worker = llm.stats().workers[0]
        peak = max(peak, worker.num_blocks - worker.num_free_blocks)
    return peak


def run_parallel_sampling(args: argparse.Namespace) -> int:
    from pagedserve.engine.sampling_params import SamplingParams

    prompt = _random_ids(random.Random(args.seed), args.prompt_len)
    one = SamplingParams(max_tokens=args.output_len, temperature=1.0, seed=args.seed, ignore_eos=True)
    # prefix caching off in both runs: sharing here comes from the fork alone
    independent = _peak_blocks(_llm(args, enable_prefix_caching=False),
                               [(prompt, dataclasses.replace(one, seed=args.seed + i)) for i in range(args.n)])
    forked = _peak_blocks(_llm(args, enable_prefix_caching=False), [(prompt, dataclasses.replace(one, n=args.n))])
    ratio = forked / independent
    print(f"\nParallel sampling: peak KV blocks, {args.prompt_len}-token prompt, {args.output_len} tokens per sample")
    print(f"{'independent x' + str(args.n):>16} {'n=' + str(args.n):>6} {'n / independent':>16}")
    print(f"{independent:>16} {forked:>6} {ratio:>16.3f}")
    _write(args, {"kv_ratio": ratio, "independent_peak_blocks": independent, "parallel_peak_blocks": forked})
    return 0


def _decode_under_arrivals(llm, args: argparse.Namespace) -> tuple[list[float], float]:
    """Decoders start together; long prompts arrive one by one while they decode.

    Returns the decoders' inter-token latencies (ms) and the output tokens/s of the whole run.
    """
    from pagedserve.engine.sampling_params import SamplingParams

    rng = random.Random(args.seed)
    decode = SamplingParams(max_tokens=args.decode_len, temperature=0.0, ignore_eos=True)
    long = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    decoders = {llm.add_request(_random_ids(rng, 32), decode) for _ in range(args.decoders)}
    arrivals = [int((i + 1) * args.decode_len / (args.long_prompts + 1)) for i in range(args.long_prompts)]
    last: dict[str, float] = {}
    itls: list[float] = []
    produced, step = 0, 0
    start = time.perf_counter()
    while llm.has_unfinished_requests():
        while arrivals and step >= arrivals[0]:
            arrivals.pop(0)
            llm.add_request(_random_ids(rng, args.long_len), long)
        deltas = llm.step()
        now = time.perf_counter()
        step += 1
        for d in deltas:
            produced += len(d.delta.token_ids)
            if d.request_id in decoders and d.delta.token_ids:
                if d.request_id in last:
                    itls.append((now - last[d.request_id]) * 1000)
                last[d.request_id] = now
    return itls, produced / (time.perf_counter() - start)


def run_chunked_prefill(args: argparse.Namespace) -> int:
    budget_off = max(args.long_len, 2048)
    with_itl, with_tps = _decode_under_arrivals(_llm(args, max_num_batched_tokens=args.budget,
                                                     enable_prefix_caching=False), args)
    without_itl, without_tps = _decode_under_arrivals(
        _llm(args, max_num_batched_tokens=budget_off, enable_chunked_prefill=False, enable_prefix_caching=False), args)
    p99_with, p99_without = float(np.percentile(with_itl, 99)), float(np.percentile(without_itl, 99))
    print(f"\nChunked prefill: {args.decoders} decoding requests, {args.long_prompts} prompts of {args.long_len} "
          f"tokens arriving (budget {args.budget} with chunking, {budget_off} without)")
    print(f"{'':<18} {'p99 ITL ms':>11} {'median ITL ms':>14} {'output tok/s':>13}")
    print(f"{'with chunking':<18} {p99_with:>11.1f} {statistics.median(with_itl):>14.1f} {with_tps:>13.1f}")
    print(f"{'without':<18} {p99_without:>11.1f} {statistics.median(without_itl):>14.1f} {without_tps:>13.1f}")
    print(f"p99 ITL with / without: {p99_with / p99_without:.3f}; throughput with / without: "
          f"{with_tps / without_tps:.3f}")
    _write(args, {"p99_itl_ratio": p99_with / p99_without, "throughput_ratio": with_tps / without_tps,
                  "p99_itl_ms": {"with": p99_with, "without": p99_without},
                  "output_tokens_per_s": {"with": with_tps, "without": without_tps}})
    return 0
