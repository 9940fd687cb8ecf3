"""`pagedserve bench structured-outputs`: what constraining requests to a JSON schema costs, in one run.

One in-process engine (prefix caching off, so both passes prefill alike), after a short warm-up:

1. Throughput: the requests (64 ShareGPT prompts, 64 output tokens each, greedy, EOS ignored so
   both passes decode the same tokens) without a structure, and every one with the JSON schema
   ``--schema`` (``grammar_schemas.SCHEMAS``), in ABBA order: output tokens/s both ways and the
   ratio (issue #22's target: at least 0.9).
2. Mask time: every call of the sampler's ``mask_grammar`` is timed (``CallTimer``) during the
   constrained pass (its full batch: the steps with the most constrained rows) and during a pass of
   the first request alone (batch 1): ms per step and microseconds per constrained row; and
   ``mask_grammar`` alone at 1, 64 and 256 rows, replaying the constrained pass's outputs
   (``mask_timing``).
3. Cold compiles beside free streams (``compile_stall``): ``--streams`` free decode streams, then
   ``--arrivals`` requests with distinct slow-to-compile schemas arrive at once; the streams' ITL
   p50/p99 before and during, and the longest gap, against the same arrivals without a structure
   and with the schemas already compiled.
4. With ``--vllm-python``: vLLM CPU's offline ``LLM.generate`` on the same requests, free and with
   the same schema, in the same ABBA order (``structured_vllm``); its own ratio, pagedserve's
   output tokens/s over vLLM's on each side, greedy agreement with pagedserve's ids, and how many
   constrained outputs of each system that ended (an EOS within the output length) validate
   against the schema.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import random
from pathlib import Path

from pagedserve.bench.call_timer import CallTimer
from pagedserve.bench.compile_stall import Arrivals, arrival_params, run_arrivals, slow_structures
from pagedserve.bench.datasets import add_dataset_arguments, dataset_spec_from_args, sample_requests
from pagedserve.bench.grammar_schemas import SCHEMAS
from pagedserve.bench.machine import machine_info, machine_line
from pagedserve.bench.mask_timing import mask_timing, replay_mask_timings
from pagedserve.bench.peer_systems import (VLLM_PYTHON_HELP, SystemRun, check_vllm_python, exit_on_peer_error,
                                           run_vllm)
from pagedserve.bench.peers import match_summary, vllm_spec
from pagedserve.bench.report import format_table, to_jsonable, write_json
from pagedserve.bench.structured_vllm import VLLM_BACKENDS, schema_validity, validity_cell, vllm_structured_config
from pagedserve.bench.throughput import ThroughputRun, add_engine_arguments, build_engine, time_engine
from pagedserve.config_flags import add_config_arguments, fields_except
from pagedserve.engine.runner_config import KERNELS, RunnerConfig

WARMUP_TOKENS = 4
FREE, CONSTRAINED = "free", "json schema"
"""The ``system`` names of the two kinds of throughput pass."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("structured-outputs", help="JSON-schema constrained vs free: throughput, mask time, "
                       "cold compiles beside decode streams, vLLM CPU beside it", description=__doc__,
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
    p.add_argument("--vllm-python", metavar="PYTHON", help=VLLM_PYTHON_HELP + " (vLLM is skipped without it)")
    p.add_argument("--vllm-structured-backend", choices=VLLM_BACKENDS, default=VLLM_BACKENDS[0],
                   help="vLLM's structured-output backend (guidance is llguidance, as pagedserve's; "
                   "default %(default)s, the one vLLM's auto picks)")
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


def _throughput(llm, prompts, requests, structure, repeats: int) -> tuple[list[SystemRun], dict[str, CallTimer]]:
    """Free and constrained passes, ``repeats`` pairs in ABBA order (free first in even pairs,
    constrained first in odd ones), so that a machine drifting steadily slower or faster weighs on
    both sides alike. Returns the passes in order (with their outputs) and the grammar work timed
    during the constrained ones: ``mask`` (the sampler's ``mask_grammar``, sized by constrained
    rows), ``advance`` (the runner feeding each sampled token to its matcher) and ``build``
    (``GrammarCompiler.matcher``)."""
    from pagedserve.engine import model_runner, sampler
    from pagedserve.engine.grammar_matchers import GrammarCompiler

    timers = {"mask": CallTimer(sampler, "mask_grammar", _constrained_rows),
              "advance": CallTimer(model_runner, "advance"), "build": CallTimer(GrammarCompiler, "matcher")}

    def free() -> SystemRun:
        outputs: list[list[int]] = []
        return SystemRun(dataclasses.replace(time_engine(llm, prompts, requests, outputs), system=FREE), outputs)

    def constrained() -> SystemRun:
        outputs: list[list[int]] = []
        with contextlib.ExitStack() as stack:
            for timer in timers.values():
                stack.enter_context(timer)
            run = time_engine(llm, prompts, requests, outputs, structured_output=structure)
        return SystemRun(dataclasses.replace(run, system=CONSTRAINED), outputs)

    pair = (free, constrained)
    return [side() for r in range(repeats) for side in (pair if r % 2 == 0 else pair[::-1])], timers


def _side(passes: list[SystemRun], system: str) -> SystemRun:
    """All passes of one side together: their tokens over their summed time; the outputs of its last pass."""
    mine = [p for p in passes if p.run.system == system]
    run = ThroughputRun(system, sum(p.run.elapsed_s for p in mine), sum(p.run.output_tokens for p in mine),
                        sum(p.run.prompt_tokens for p in mine))
    return SystemRun(run, mine[-1].outputs, mine[-1].info)


def _constrained_rows(logits, matchers) -> int:
    return sum(m is not None for m in matchers)


def _run_figures(passes: list[SystemRun]) -> dict:
    """``passes`` (one system's) as report entries: each pass, each side, the constrained / free ratio."""
    free, constrained = _side(passes, FREE).run, _side(passes, CONSTRAINED).run

    def entry(run: ThroughputRun) -> dict:
        return dataclasses.asdict(run) | {"output_tokens_per_s": run.output_tokens_per_s}

    return {"ratio": constrained.output_tokens_per_s / free.output_tokens_per_s, "free": entry(free),
            "constrained": entry(constrained), "passes": [entry(p.run) for p in passes]}


def _compile_stalls(llm, args: argparse.Namespace) -> tuple[list, list[float]]:
    """Phase 3, ``--repeats`` times with fresh schemas: the stall runs and the gateway's spec-check ms."""
    rng = random.Random(args.seed)
    stalls, check_ms = [], []
    for repeat in range(args.repeats):
        cold_params, checks = arrival_params(slow_structures(args.arrivals, args.seed + repeat), args.arrival_tokens)
        free_params, _ = arrival_params([None] * args.arrivals, args.arrival_tokens)
        check_ms += checks
        stalls += [run_arrivals(llm, kind, repeat, params, args.streams, args.before_tokens, args.arrival_tokens, rng)
                   for kind, params in ((Arrivals.FREE, free_params), (Arrivals.COLD, cold_params),
                                        (Arrivals.WARM, cold_params))]
    return stalls, check_ms


def _vllm_report(args: argparse.Namespace, model, prompts: list[list[int]], requests: list,
                 passes: list[SystemRun], tokenizer, eos: list[int]) -> dict:
    """vLLM's passes over the requests, in the order of pagedserve's ``passes``, with the same
    schema (``--schema``) on the constrained ones; its figures, validity and greedy agreement."""
    schema = SCHEMAS[args.schema][0]
    spec = vllm_spec(model, prompts, requests, args) | {
        "structured_outputs_config": vllm_structured_config(args.vllm_structured_backend)}
    order = [(p.run.system, {"json": schema} if p.run.system == CONSTRAINED else None) for p in passes]
    vllm = run_vllm(args.vllm_python, spec, prompts, [r.expected_output_len for r in requests], order)
    return _run_figures(vllm) | {
        "info": vllm[0].info,
        "validity": schema_validity(tokenizer, _side(vllm, CONSTRAINED).outputs, schema, eos),
        "same_greedy_ids": {side: match_summary(_side(passes, side).outputs, _side(vllm, side).outputs, eos)
                            for side in (FREE, CONSTRAINED)}}


def run(args: argparse.Namespace) -> int:
    return exit_on_peer_error("structured-outputs", _run, args)


def _run(args: argparse.Namespace) -> int:
    if args.vllm_python:  # fail before the long engine run (and torch's import), not after it
        check_vllm_python(args.vllm_python)
    import gc

    from transformers import AutoTokenizer

    from pagedserve.engine import sampler
    from pagedserve.engine.structured_output import StructuredOutput, StructureKind
    from pagedserve.model_files import resolve_model

    model = resolve_model(args.model or None)
    tokenizer = AutoTokenizer.from_pretrained(model)
    requests = sample_requests(dataset_spec_from_args(args), tokenizer)
    prompts = [tokenizer.encode(r.prompt) for r in requests]
    schema = SCHEMAS[args.schema][0]
    structure = StructuredOutput(StructureKind.JSON, json.dumps(schema))
    llm = build_engine(model, args, enable_prefix_caching=False)
    _warm_up(llm, structure)
    passes, timers = _throughput(llm, prompts, requests, structure, args.repeats)
    with CallTimer(sampler, "mask_grammar", _constrained_rows) as alone:
        time_engine(llm, prompts[:1], requests[:1], structured_output=structure)
    stalls, check_ms = _compile_stalls(llm, args)
    eos = list(llm.tokenizer.info.eos_token_ids)
    llm.close()
    del llm  # its memory is freed before the replays and vLLM run
    gc.collect()
    figures = _run_figures(passes)
    constrained = _side(passes, CONSTRAINED)
    report = {
        "schema": args.schema, **figures,
        "grammar_share_of_constrained_passes": {name: t.total_s / figures["constrained"]["elapsed_s"]
                                                for name, t in timers.items()},
        "validity": schema_validity(tokenizer, constrained.outputs, schema, eos),
        "mask": [mask_timing(alone.calls), mask_timing(timers["mask"].calls)],
        "mask_replay": replay_mask_timings(model, structure, constrained.outputs),
        "gateway_check_ms": check_ms, "compile_stall": stalls, "machine": machine_info(),
        "settings": {k: v for k, v in vars(args).items() if k != "func"}}
    if args.vllm_python:
        report["vllm"] = _vllm_report(args, model, prompts, requests, passes, tokenizer, eos)
    report = to_jsonable(report)
    print_report(report, args)
    if args.result_json:
        write_json(args.result_json, report)
    return 0


def print_report(report: dict, args: argparse.Namespace) -> None:
    """The tables of ``report`` (the dict written with --result-json)."""
    print(f"\nStructured outputs, {report['passes'][0]['output_tokens']} output tokens over {args.num_prompts} requests a pass, "
          f"schema {report['schema']} ({machine_line(report['machine'])})")
    print(format_table(["pass", "elapsed s", "output tok/s"],
                       [[p["system"], p["elapsed_s"], p["output_tokens_per_s"]] for p in report["passes"]]))
    shares = ", ".join(f"{name} {100 * share:.1f}%"
                       for name, share in report["grammar_share_of_constrained_passes"].items())
    print(f"ratio json schema / free (all passes of each side): {report['ratio']:.3f}x (target >= 0.9); "
          f"grammar work in the constrained passes: {shares}; outputs of the json schema passes: "
          f"{validity_cell(report['validity'])} (valid/ended on-schema/requests)\n")
    if "vllm" in report:
        print_vllm(report)
    mask = [["engine pass", *m.values()] for m in report["mask"]] + [["replay", *m.values()] for m in report["mask_replay"]]
    print(format_table(["measured in", "batch", "steps", "mask ms/step p50", "mask ms/step mean", "us per row"], mask))
    checks = report["gateway_check_ms"]
    print(f"\n{args.streams} free streams; {args.arrivals} requests arrive at once (gateway spec check of the "
          f"cold schemas: {min(checks):.0f}-{max(checks):.0f} ms each, done before they arrive)")
    print(format_table(["arrivals", "repeat", "ITL p50 before", "ITL p99 before", "ITL p50 during", "ITL p99 during",
                        "longest gap ms", "arrivals' last TTFT ms", "worker compile ms", "longest compile ms"],
                       [list(s.values()) for s in report["compile_stall"]]))


def print_vllm(report: dict) -> None:
    """pagedserve and vLLM side by side: each side's output tokens/s (all its passes), each
    system's json schema / free ratio, pagedserve's tokens/s over vLLM's, how many constrained
    outputs validate, and how many requests give pagedserve's greedy ids."""
    vllm = report["vllm"]
    rows = []
    for system, figures in (("pagedserve", report), ("vllm", vllm)):
        same = vllm["same_greedy_ids"] if system == "vllm" else None
        rows.append([system, figures["free"]["output_tokens_per_s"], figures["constrained"]["output_tokens_per_s"],
                     figures["ratio"], *(report[side]["output_tokens_per_s"] / figures[side]["output_tokens_per_s"]
                                         for side in ("free", "constrained")),
                     validity_cell(figures["validity"]),
                     *((f"{same[s]['same']}/{vllm['validity']['requests']}" if same else "reference")
                       for s in (FREE, CONSTRAINED))])
    print(f"vLLM {vllm['info']['vllm_version']} (structured-output backend {vllm['info']['structured_outputs_backend']}), "
          f"passes in the same order: " + ", ".join(f"{p['system']} {p['elapsed_s']:.2f} s" for p in vllm["passes"]))
    print(format_table(["system", "free tok/s", "json tok/s", "json / free", "pagedserve / it free",
                        "pagedserve / it json", "valid/ended on-schema/requests", "same ids free", "same ids json"], rows) + "\n")
