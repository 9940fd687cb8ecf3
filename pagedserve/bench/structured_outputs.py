"""`pagedserve bench structured-outputs`: what constraining requests to a JSON schema costs, in one run.

One in-process engine (prefix caching off, so both passes prefill alike), after a short warm-up:

1. Throughput: the requests (64 ShareGPT prompts, 64 output tokens each, greedy, EOS ignored so
   both passes decode the same tokens) without a structure, and every one with the JSON schema
   ``--schema`` (``grammar_schemas.SCHEMAS``), in ABBA order: output tokens/s both ways and the
   ratio (issue #22's target: at least 0.9).
2. Mask time: every call of the sampler's ``mask_grammar`` is timed (``CallTimer``) during the
   constrained pass (its full batch: the steps with the most constrained rows) and during a pass of
   the first request alone (batch 1): ms per step and microseconds per constrained row.
3. Cold compiles beside free streams (``compile_stall``): ``--streams`` free decode streams, then
   ``--arrivals`` requests with distinct slow-to-compile schemas arrive at once; the streams' ITL
   p50/p99 before and during, and the longest gap, against the same arrivals without a structure
   and with the schemas already compiled.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import random
from dataclasses import dataclass
from pathlib import Path

from pagedserve.bench.call_timer import CallTimer
from pagedserve.bench.compile_stall import Arrivals, arrival_params, run_arrivals, slow_structures
from pagedserve.bench.datasets import add_dataset_arguments, dataset_spec_from_args, sample_requests
from pagedserve.bench.grammar_schemas import SCHEMAS
from pagedserve.bench.machine import machine_info, machine_line
from pagedserve.bench.report import format_table, to_jsonable, write_json
from pagedserve.bench.throughput import ThroughputRun, add_engine_arguments, build_engine, time_engine
from pagedserve.config_flags import add_config_arguments, fields_except
from pagedserve.engine.runner_config import KERNELS, RunnerConfig

WARMUP_TOKENS = 4
FREE, CONSTRAINED = "free", "json schema"
"""The ``system`` names of the two kinds of throughput pass."""


@dataclass(frozen=True)
class MaskTiming:
    """``mask_grammar`` at one batch size.

    Attributes:
        batch: constrained rows per step.
        steps: steps timed at that batch.
        ms_per_step_p50, ms_per_step_mean: time in ``mask_grammar`` per step, ms.
        us_per_row: ``ms_per_step_mean`` per constrained row, microseconds.
    """

    batch: int
    steps: int
    ms_per_step_p50: float
    ms_per_step_mean: float
    us_per_row: float


def mask_timing(calls: list[tuple[int, float]]) -> MaskTiming:
    """The figures of the calls at the largest batch among ``calls`` ((rows, seconds) pairs)."""
    import statistics

    batch = max(rows for rows, _ in calls)
    seconds = [s for rows, s in calls if rows == batch]
    mean_ms = 1000 * statistics.fmean(seconds)
    return MaskTiming(batch, len(seconds), 1000 * statistics.median(seconds), mean_ms, 1000 * mean_ms / batch)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("structured-outputs", help="JSON-schema constrained vs free: throughput, mask time, "
                       "cold compiles beside decode streams", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="", help="model folder (default: the default model)")
    add_dataset_arguments(p)
    p.add_argument("--schema", choices=sorted(SCHEMAS), default="nested",
                   help="the JSON schema of the constrained pass (default %(default)s)")
    p.add_argument("--streams", type=int, default=8, help="free decode streams of phase 3 (default %(default)s)")
    p.add_argument("--arrivals", type=int, default=10,
                   help="requests with distinct slow-to-compile schemas arriving at once (default %(default)s)")
    p.add_argument("--before-tokens", type=int, default=16,
                   help="tokens each stream decodes before the arrival (default %(default)s)")
    p.add_argument("--arrival-tokens", type=int, default=8,
                   help="tokens each arrival decodes before the streams stop (default %(default)s)")
    p.add_argument("--repeats", type=int, default=2,
                   help="times each comparison runs: throughput passes in ABBA order, each side's tokens over "
                   "its summed time; the compile phase with fresh schemas each time (default %(default)s)")
    add_engine_arguments(p)
    add_config_arguments(p, RunnerConfig, exclude=fields_except(RunnerConfig, KERNELS))
    p.add_argument("--result-json", type=Path, help="write every figure here")
    p.set_defaults(func=run, dtype="float32", device="cpu", output_len=64)


def _warm_up(llm, structure) -> None:
    """Two short requests, one constrained: the compiler's vocabulary, the schema's grammar and
    the code paths are ready before anything is timed."""
    from pagedserve.engine.sampling_params import SamplingParams

    prompt = list(range(1000, 1032))
    for constraint in (None, structure):
        llm.add_request(prompt, SamplingParams(max_tokens=WARMUP_TOKENS, temperature=0.0, ignore_eos=True,
                                               structured_output=constraint))
    while llm.has_unfinished_requests():
        llm.step()


def _throughput(llm, prompts, requests, structure, repeats: int) -> tuple[list, dict[str, CallTimer]]:
    """Free and constrained passes, ``repeats`` pairs in ABBA order (free first in even pairs,
    constrained first in odd ones), so that a machine drifting steadily slower or faster weighs on
    both sides alike. Returns the passes in order and the grammar work timed during the
    constrained ones: ``mask`` (the sampler's ``mask_grammar``, sized by constrained rows),
    ``advance`` (the runner feeding each sampled token to its matcher) and ``build``
    (``GrammarCompiler.matcher``)."""
    from pagedserve.engine import model_runner, sampler
    from pagedserve.engine.grammar_matchers import GrammarCompiler

    timers = {"mask": CallTimer(sampler, "mask_grammar", _constrained_rows),
              "advance": CallTimer(model_runner, "advance"), "build": CallTimer(GrammarCompiler, "matcher")}

    def free() -> ThroughputRun:
        return dataclasses.replace(time_engine(llm, prompts, requests), system=FREE)

    def constrained() -> ThroughputRun:
        with contextlib.ExitStack() as stack:
            for timer in timers.values():
                stack.enter_context(timer)
            run = time_engine(llm, prompts, requests, structured_output=structure)
        return dataclasses.replace(run, system=CONSTRAINED)

    pair = (free, constrained)
    passes = [side() for r in range(repeats) for side in (pair if r % 2 == 0 else pair[::-1])]
    return passes, timers


def _side(passes: list, system: str) -> ThroughputRun:
    """All passes of one side together: their tokens over their summed time."""
    mine = [p for p in passes if p.system == system]
    return ThroughputRun(system, sum(p.elapsed_s for p in mine), sum(p.output_tokens for p in mine),
                         sum(p.prompt_tokens for p in mine))


def _constrained_rows(logits, matchers) -> int:
    return sum(m is not None for m in matchers)


def run(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from pagedserve.engine import sampler
    from pagedserve.engine.structured_output import StructuredOutput, StructureKind
    from pagedserve.model_files import resolve_model

    model = resolve_model(args.model or None)
    tokenizer = AutoTokenizer.from_pretrained(model)
    requests = sample_requests(dataset_spec_from_args(args), tokenizer)
    prompts = [tokenizer.encode(r.prompt) for r in requests]
    structure = StructuredOutput(StructureKind.JSON, json.dumps(SCHEMAS[args.schema][0]))
    llm = build_engine(model, args, enable_prefix_caching=False)
    _warm_up(llm, structure)
    passes, timers = _throughput(llm, prompts, requests, structure, args.repeats)
    free, constrained = _side(passes, FREE), _side(passes, CONSTRAINED)
    with CallTimer(sampler, "mask_grammar", _constrained_rows) as alone:
        time_engine(llm, prompts[:1], requests[:1], structured_output=structure)
    rng = random.Random(args.seed)
    stalls, check_ms = [], []
    for repeat in range(args.repeats):
        cold_params, checks = arrival_params(slow_structures(args.arrivals, args.seed + repeat), args.arrival_tokens)
        free_params, _ = arrival_params([None] * args.arrivals, args.arrival_tokens)
        check_ms += checks
        stalls += [run_arrivals(llm, kind, repeat, params, args.streams, args.before_tokens, args.arrival_tokens, rng)
                   for kind, params in ((Arrivals.FREE, free_params), (Arrivals.COLD, cold_params),
                                        (Arrivals.WARM, cold_params))]
    report = to_jsonable({
        "schema": args.schema, "ratio": constrained.output_tokens_per_s / free.output_tokens_per_s,
        "free": dataclasses.asdict(free) | {"output_tokens_per_s": free.output_tokens_per_s},
        "constrained": dataclasses.asdict(constrained) | {"output_tokens_per_s": constrained.output_tokens_per_s},
        "passes": [dataclasses.asdict(p) | {"output_tokens_per_s": p.output_tokens_per_s} for p in passes],
        "grammar_share_of_constrained_passes": {name: t.total_s / constrained.elapsed_s for name, t in timers.items()},
        "mask": [mask_timing(alone.calls), mask_timing(timers["mask"].calls)],
        "gateway_check_ms": check_ms, "compile_stall": stalls, "machine": machine_info(),
        "settings": {k: v for k, v in vars(args).items() if k != "func"}})
    print_report(report, args)
    if args.result_json:
        write_json(args.result_json, report)
    return 0


def print_report(report: dict, args: argparse.Namespace) -> None:
    """The three tables of ``report`` (the dict written with --result-json)."""
    print(f"\nStructured outputs, {report['passes'][0]['output_tokens']} output tokens over {args.num_prompts} requests a pass, "
          f"schema {report['schema']} ({machine_line(report['machine'])})")
    print(format_table(["pass", "elapsed s", "output tok/s"],
                       [[p["system"], p["elapsed_s"], p["output_tokens_per_s"]] for p in report["passes"]]))
    shares = ", ".join(f"{name} {100 * share:.1f}%"
                       for name, share in report["grammar_share_of_constrained_passes"].items())
    print(f"ratio json schema / free (all passes of each side): {report['ratio']:.3f}x (target >= 0.9); "
          f"grammar work in the constrained passes: {shares}\n")
    print(format_table(["batch", "steps", "mask ms/step p50", "mask ms/step mean", "us per row"],
                       [[m["batch"], m["steps"], m["ms_per_step_p50"], m["ms_per_step_mean"], m["us_per_row"]]
                        for m in report["mask"]]))
    checks = report["gateway_check_ms"]
    print(f"\n{args.streams} free streams; {args.arrivals} requests arrive at once (gateway spec check of the "
          f"cold schemas: {min(checks):.0f}-{max(checks):.0f} ms each, done before they arrive)")
    print(format_table(["arrivals", "repeat", "ITL p50 before", "ITL p99 before", "ITL p50 during", "ITL p99 during",
                        "longest gap ms", "arrivals' last TTFT ms", "worker compile ms", "longest compile ms"],
                       [list(s.values()) for s in report["compile_stall"]]))
