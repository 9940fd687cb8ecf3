"""`pagedserve bench tensor-parallel`: offline throughput of one worker split over T ranks vs one rank.

For each size T a fresh in-process engine (``LLM(tensor_parallel_size=T)``: rank 0 here, T-1 helper
processes over gloo) runs the same seeded random-token prompts, greedy with EOS ignored, to
``--max-tokens`` each; a short warm-up request runs first and is not timed. The ranks share this
machine's cores: each gets ``cores // T`` torch threads (rank 0 included), so on a CPU the table
gives the price of the communication (two all-reduces per layer, the embedding's all-reduce, the
logits' all-gather and two object broadcasts per step; Shoeybi et al., 2019, §3) against the
smaller GEMMs, not a speed-up from more hardware.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

from pagedserve.bench.machine import machine_info, machine_line
from pagedserve.bench.report import format_table


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tensor-parallel", help="offline throughput with T ranks per worker vs one",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1,3", help="comma-separated tensor-parallel sizes (default %(default)s: "
                   "the default model has 9 heads and 3 KV heads)")
    add_run_arguments(p)
    p.set_defaults(func=main)


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """The model and run-shape flags of the parallelism benchmarks."""
    p.add_argument("--model", default="", help="model folder (default: the default model)")
    p.add_argument("--num-prompts", type=int, default=16, help="prompts (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per prompt (default %(default)s)")
    p.add_argument("--kv-cache-memory", default="256MiB", help="KV-cache memory per rank (default %(default)s)")
    p.add_argument("--result-json", type=Path, help="write every figure to this file")


def random_prompts(vocab_size: int, num_prompts: int, seed: int = 0) -> list[list[int]]:
    """Random token ids, 16 to 128 per prompt (seeded)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(rng.randint(16, 128))] for _ in range(num_prompts)]


def run_size(model: Path, size: int, prompts: list[list[int]], max_tokens: int, kv_memory: str) -> dict:
    """One engine of ``size`` ranks over ``prompts``: elapsed seconds and output tokens/s."""
    import torch

    from pagedserve.engine.sampling_params import SamplingParams
    from pagedserve.llm import LLM

    threads = max(1, (os.cpu_count() or 1) // size)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    try:
        with LLM(model, kv_cache_memory=kv_memory, tensor_parallel_size=size) as llm:
            llm.generate([prompts[0][:8]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
            start = time.perf_counter()
            outputs = llm.generate(prompts, params)
            elapsed = time.perf_counter() - start
    finally:
        torch.set_num_threads(previous)
    tokens = sum(len(o.token_ids) for o in outputs)
    return {"tensor_parallel_size": size, "threads_per_rank": threads, "elapsed_s": elapsed,
            "output_tokens": tokens, "output_tokens_per_s": tokens / elapsed}


def main(args: argparse.Namespace) -> int:
    from pagedserve.engine.models.registry import load_model_config
    from pagedserve.model_files import resolve_model

    model = resolve_model(args.model or None)
    prompts = random_prompts(load_model_config(model).vocab_size, args.num_prompts)
    runs = [run_size(model, int(s), prompts, args.max_tokens, args.kv_cache_memory) for s in args.sizes.split(",")]
    base = runs[0]["output_tokens_per_s"]
    info = machine_info()
    print(format_table(["TP", "threads/rank", "elapsed s", "output tok/s", f"vs TP={runs[0]['tensor_parallel_size']}"],
                       [[r["tensor_parallel_size"], r["threads_per_rank"], r["elapsed_s"], r["output_tokens_per_s"],
                         r["output_tokens_per_s"] / base] for r in runs],
                       title=f"Tensor parallel, {model.name}, {len(prompts)} prompts x {args.max_tokens} tokens "
                       f"({machine_line(info)})"))
    if args.result_json:
        args.result_json.write_text(json.dumps({"machine": info, "model": str(model), "runs": runs}, indent=2))
    return 0
