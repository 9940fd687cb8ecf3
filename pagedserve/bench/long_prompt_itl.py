"""`pagedserve bench long-prompt-itl`: how much one long prompt slows the streams decoding beside it.

For each configuration (token budget and ``max_decode_slowdown``, see
``pagedserve/engine/step_cost.py``) a fresh in-process engine runs ``--streams`` greedy decode
streams (random 32-token prompts, EOS ignored) alone for ``--alone-tokens`` tokens each; then the
same number of fresh streams, and once each has its first tokens, one ``--long-prompt``-token
prompt arrives. The streams run until that prompt's first token (its TTFT), then are stopped.

The table gives the p50/p99 inter-token latency (gaps between consecutive tokens of a stream,
from the step outputs) of the streams alone and beside the long prompt, the ratio of the two
p99s (the issue's target: at most 3), and the long prompt's TTFT. ``inf`` as the slowdown is the
baseline: prefill chunks fill the token budget.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from pagedserve.config_flags import add_config_arguments, fields_except
from pagedserve.engine.runner_config import KERNELS, RunnerConfig, kernel_options
from pagedserve.bench.machine import machine_info, machine_line
from pagedserve.bench.metrics import latency_stats
from pagedserve.bench.report import format_table
from pagedserve.bench.throughput import add_plans_in_flight_argument
from pagedserve.engine.config import CPU_TOKEN_BUDGET

STREAM_PROMPT_TOKENS = 32
WARM_TOKENS = 3
"""Tokens every stream has before the long prompt arrives (their prefill is behind them)."""
BESIDE_MAX_TOKENS = 2048
"""The streams' limit beside the long prompt (they are stopped at its first token, long before)."""


@dataclass(frozen=True)
class LongPromptRun:
    """One configuration (times in milliseconds).

    Attributes:
        budget: ``max_num_batched_tokens``.
        max_decode_slowdown: the engine's setting (``inf``: chunks fill the budget).
        alone_p50_ms, alone_p99_ms: the streams' inter-token latency alone.
        beside_p50_ms, beside_p99_ms: the same while the long prompt is prefilled.
        p99_ratio: ``beside_p99_ms / alone_p99_ms``.
        longest_gap_ms: the longest gap of any stream beside the long prompt.
        long_ttft_ms: from the long prompt's arrival to its first token.
    """

    budget: int
    max_decode_slowdown: float
    alone_p50_ms: float
    alone_p99_ms: float
    beside_p50_ms: float
    beside_p99_ms: float
    p99_ratio: float
    longest_gap_ms: float
    long_ttft_ms: float


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("long-prompt-itl", help="inter-token latency of decode streams beside one long prompt",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="", help="model folder (default: the default model)")
    p.add_argument("--configs", default=f"{CPU_TOKEN_BUDGET}:inf,{CPU_TOKEN_BUDGET}:2",
                   help="comma-separated BUDGET:SLOWDOWN pairs (max_num_batched_tokens, max_decode_slowdown) "
                   "(default %(default)s)")
    p.add_argument("--streams", type=int, default=8, help="decode streams (default %(default)s)")
    p.add_argument("--long-prompt", type=int, default=8000, help="tokens of the long prompt (default %(default)s)")
    p.add_argument("--alone-tokens", type=int, default=48,
                   help="tokens each stream decodes in the run without the long prompt (default %(default)s)")
    p.add_argument("--kv-cache-memory", default="1GiB", help="engine KV-cache memory (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts (default %(default)s)")
    add_config_arguments(p, RunnerConfig, exclude=fields_except(RunnerConfig, KERNELS))
    add_plans_in_flight_argument(p)
    p.add_argument("--result-json", type=Path, help="write every figure to this file")
    p.set_defaults(func=main)


def _gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:])]


def _run_streams(llm, prompts: list[list[int]], max_tokens: int,
                 long_prompt: list[int] | None) -> tuple[list[float], float]:
    """Decodes ``prompts``; with ``long_prompt``, adds it once every stream has ``WARM_TOKENS``
    tokens and stops at its first token. Returns the streams' gaps (seconds; only those after the
    long prompt's arrival when there is one) and the long prompt's TTFT (0 without one)."""
    from pagedserve.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    times: dict[str, list[float]] = {llm.add_request(p, params): [] for p in prompts}
    long_id, arrived, first = None, 0.0, 0.0
    while llm.has_unfinished_requests():
        outputs = llm.step()
        now = time.perf_counter()
        for item in outputs:
            if item.request_id == long_id and item.delta.token_ids:
                first = now
            elif item.request_id in times:
                times[item.request_id] += [now] * len(item.delta.token_ids)
        if long_prompt is not None and long_id is None and all(len(t) >= WARM_TOKENS for t in times.values()):
            long_id, arrived = llm.add_request(long_prompt, SamplingParams(max_tokens=1, ignore_eos=True)), now
        if first:
            break
    for request_id in times:
        llm.abort(request_id)
    if long_prompt is None:
        return [g for t in times.values() for g in _gaps(t)], 0.0
    return [b - max(a, arrived) for t in times.values() for a, b in zip(t, t[1:]) if b > arrived], first - arrived


def run_config(model: Path, args: argparse.Namespace, budget: int, slowdown: float) -> LongPromptRun:
    """Both phases on a fresh engine with this token budget and decode slowdown."""
    from pagedserve.llm import LLM

    rng = random.Random(args.seed)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(1000, 20000) for _ in range(n)]

    with LLM(model, kv_cache_memory=args.kv_cache_memory, max_num_batched_tokens=budget, dtype="float32",
             **kernel_options(args),
             max_plans_in_flight=args.max_plans_in_flight, max_decode_slowdown=slowdown,
             admission_headroom=args.admission_headroom) as llm:
        alone, _ = _run_streams(llm, [prompt(STREAM_PROMPT_TOKENS) for _ in range(args.streams)], args.alone_tokens, None)
        streams = [prompt(STREAM_PROMPT_TOKENS) for _ in range(args.streams)]
        beside, ttft = _run_streams(llm, streams, BESIDE_MAX_TOKENS, prompt(args.long_prompt))
    a, b = latency_stats(alone), latency_stats(beside)
    return LongPromptRun(budget, slowdown, a.median_ms, a.p99_ms, b.median_ms, b.p99_ms, b.p99_ms / a.p99_ms,
                         1000 * max(beside), 1000 * ttft)


def main(args: argparse.Namespace) -> int:
    from pagedserve.model_files import resolve_model

    model = resolve_model(args.model or None)
    runs = []
    for config in args.configs.split(","):
        budget, slowdown = config.split(":")
        print(f"budget {budget}, max decode slowdown {slowdown} ...", flush=True)
        runs.append(run_config(model, args, int(budget), float(slowdown)))
    print(f"\n{args.streams} streams beside one {args.long_prompt}-token prompt, gemm backend {args.gemm_backend}, "
          f"{args.compile_mode} ({machine_line(machine_info())})")
    print(format_table(["budget", "slowdown", "ITL p50 alone", "ITL p99 alone", "ITL p50 beside", "ITL p99 beside",
                        "p99 ratio", "longest gap ms", "long TTFT ms"],
                       [[r.budget, r.max_decode_slowdown, r.alone_p50_ms, r.alone_p99_ms, r.beside_p50_ms,
                         r.beside_p99_ms, f"{r.p99_ratio:.2f}", r.longest_gap_ms, r.long_ttft_ms] for r in runs]))
    if args.result_json:
        args.result_json.write_text(json.dumps({"runs": [asdict(r) for r in runs], "streams": args.streams,
                                                "long_prompt": args.long_prompt, "machine": machine_info()}, indent=2))
    return 0
