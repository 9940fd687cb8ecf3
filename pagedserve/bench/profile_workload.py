"""`pagedserve bench profile-workload`: where a whole offline run's time goes.

The requests of a dataset (all submitted at once, greedy, EOS ignored, each its own output length,
as `bench throughput` runs them) go through the in-process engine with the timers of `bench
profile` around each piece, accumulated over the run. The table gives each piece's seconds and its
share of the engine steps' time: on ShareGPT the contexts grow to hundreds of tokens, so attention
weighs far more than in `bench profile`'s short-context decode cases.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pagedserve.config_flags import add_config_arguments, fields_except
from pagedserve.engine.runner_config import KERNELS, RunnerConfig
from pagedserve.bench.datasets import add_dataset_arguments, dataset_spec_from_args, sample_requests
from pagedserve.bench.machine import machine_info, machine_line
from pagedserve.bench.profile import StepTimers, add_dtype_argument, instrument
from pagedserve.bench.report import format_table
from pagedserve.bench.throughput import add_engine_arguments, build_engine, time_engine


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile-workload", help="seconds per engine piece over a whole offline dataset run",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="", help="model folder (default: the default model)")
    add_dataset_arguments(p)
    add_engine_arguments(p)
    add_config_arguments(p, RunnerConfig, exclude=fields_except(RunnerConfig, KERNELS))
    add_dtype_argument(p)
    p.add_argument("--result-json", type=Path, help="write every figure to this file")
    p.set_defaults(func=main, device="cpu")


def main(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from pagedserve.model_files import resolve_model

    model = resolve_model(args.model or None)
    tokenizer = AutoTokenizer.from_pretrained(model)
    requests = sample_requests(dataset_spec_from_args(args), tokenizer)
    prompts = [tokenizer.encode(r.prompt) for r in requests]
    llm = build_engine(model, args)
    timers = StepTimers()
    instrument(llm.engine.executor.runners["worker-0"], timers)
    run = time_engine(llm, prompts, requests)
    seconds = {k: v / 1000 for k, v in sorted(timers.take().ms.items(), key=lambda kv: -kv[1])}
    steps = seconds.get("step", 0.0)
    print(f"\n{len(requests)} requests, {run.output_tokens} output tokens in {run.elapsed_s:.1f} s "
          f"({run.output_tokens_per_s:.1f} output tok/s), {args.dtype}, gemm backend {args.gemm_backend}, "
          f"{args.compile_mode} "
          f"({machine_line(machine_info())})")
    print(format_table(["piece", "seconds", "share of steps"],
                       [[k, v, f"{100 * v / steps:.1f}%" if steps else "-"] for k, v in seconds.items()]))
    if args.result_json:
        args.result_json.write_text(json.dumps({"elapsed_s": run.elapsed_s, "output_tokens": run.output_tokens,
                                                "seconds": seconds, "machine": machine_info(),
                                                "dtype": args.dtype, "gemm_backend": args.gemm_backend,
                                                "compile_mode": args.compile_mode}, indent=2))
    return 0
