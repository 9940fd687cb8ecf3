"""`pagedserve bench peers`: offline throughput and greedy agreement, pagedserve vs vLLM CPU and llama.cpp.

The same sampled requests (the prompts' token ids, each request's own output length, EOS ignored,
greedy) run through these systems, each with the same --dtype (weights and activations, float32 or
bfloat16) and --kv-cache-dtype (what the KV cache stores):

  pagedserve  the in-process engine, all requests submitted at once (as `bench throughput` runs it),
              once per --engines entry (pagedserve: the defaults; pagedserve-torch: F.linear, the
              reference GEMMs; -onednn / -panels: that GEMM named explicitly; -inductor: compiled dense
              part, opt-in);
  vllm        vLLM's offline LLM.generate, in a subprocess of the Python given by --vllm-python
              (a separate vLLM CPU install; the driver is pagedserve/bench/vllm_driver.py);
  llama.cpp   a running llama-server given by --llama-server-url, all requests sent at once; its
              precision is the GGUF it was started with (F32 or BF16, and -ctk/-ctv for the cache):
              start it to match (docs/benchmarks.md).

Each system gets one untimed warm-up request first. A peer is skipped when its option is not given.
The table gives each system's elapsed seconds, output and total (prompt + output) tokens/s, the ratio
of the fastest pagedserve row's output tokens/s to the system's, and how many requests generated
exactly the same token ids as the first pagedserve row (with the median position of the first differing token when not all did:
float32 sums in another order can flip a near-tie and the texts part from there), and how many of
the differing requests first differ where pagedserve generated an EOS token: llama.cpp's ignore_eos
bans EOS tokens, where pagedserve and vLLM generate them and only do not stop.
Installing the peers: docs/benchmarks.md, "Peers: vLLM CPU and llama.cpp (`bench peers`)".
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from collections.abc import Sequence
from pathlib import Path

from pagedserve.bench.datasets import SampleRequest, add_dataset_arguments, dataset_spec_from_args, sample_requests
from pagedserve.bench.machine import machine_info, machine_line
from pagedserve.bench.peer_systems import (VLLM_PYTHON_HELP, SystemRun, check_vllm_python, exit_on_peer_error,
                                           kv_cache_gib, llama_server_props, run_llama_server, run_vllm)
from pagedserve.bench.peer_rounds import fastest_pagedserve, rounds_table, run_rounds
from pagedserve.bench.report import format_table, write_json
from pagedserve.bench.vllm_driver import DEFAULT_ENGINE_CORE, ENGINE_CORES
from pagedserve.bench.throughput import add_engine_arguments, build_engine, time_engine
from pagedserve.config_flags import add_config_arguments, fields_except
from pagedserve.engine.config import CompileMode, GemmBackend, KVCacheDtype
from pagedserve.engine.runner_config import RunnerConfig
from pagedserve.units import positive

WARMUP_TOKEN_IDS = list(range(1000, 1032))
"""The warm-up prompt: 32 token ids no sampled prompt starts with, so no prefix cache is primed."""
WARMUP_TOKENS = 4
"""Tokens the warm-up request generates."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "peers", help="offline throughput and greedy agreement: the in-process engine vs vLLM CPU and llama.cpp",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="", help="HF model folder (default: the default model); llama-server "
                   "must serve the same model, converted to GGUF of the same --dtype (f32 or bf16)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="weights and activations of pagedserve and vLLM (default %(default)s); bfloat16 needs a "
                        "CPU with native bfloat16 (AVX512_BF16 or AMX)")
    add_dataset_arguments(p)
    g = p.add_argument_group("peers (each one is skipped when its option is not given)")
    g.add_argument("--vllm-python", metavar="PYTHON",
                   help=VLLM_PYTHON_HELP)
    g.add_argument("--vllm-engine-core", default=DEFAULT_ENGINE_CORE, choices=ENGINE_CORES,
                   help="where vLLM's engine core runs: its own process (vLLM's default, %(default)s) or the "
                        "driver's (in_process: faster on 2 cores, see docs/benchmarks.md)")
    g.add_argument("--llama-server-url", metavar="URL", help="a running llama-server, e.g. http://127.0.0.1:8091")
    g = p.add_argument_group("pagedserve engine (vLLM gets the same sequence and batch limits, and the KV-cache "
                             "memory rounded up to whole GiB)")
    add_engine_arguments(g)
    add_config_arguments(g, RunnerConfig, exclude=fields_except(RunnerConfig, {"kv_cache_dtype"}))
    g.add_argument("--engines", default="auto", type=_engine_variants,
                   help="comma-separated: one pagedserve row per engine variant GEMM[+COMPILE], the first is "
                        "the reference for greedy agreement; GEMM auto (the default: panels or onednn on CPU), "
                        "torch (F.linear, the reference kernels), onednn or panels, COMPILE eager (when omitted) or inductor "
                        "(opt-in; see pagedserve worker --help), e.g. auto,torch,auto+inductor (default %(default)s)")
    p.add_argument("--rounds", type=positive(int), default=1,
                   help="run every system this many times, in turn: the order reverses each round, so a machine "
                        "whose memory bandwidth drifts during the run slows each side alike; the table per round "
                        "and each system's median over the rounds (default %(default)s)")
    p.add_argument("--result-json", type=Path, help="write settings, machine, every figure and per-request matches")
    p.set_defaults(func=run, device="cpu")


def first_mismatch(reference: Sequence[int], other: Sequence[int]) -> int | None:
    """The first position (0-based, in generated tokens) where ``other`` differs from ``reference``,
    the shorter length when one is a prefix of the other, or None when they are equal."""
    for i, (a, b) in enumerate(zip(reference, other)):
        if a != b:
            return i
    return None if len(reference) == len(other) else min(len(reference), len(other))


def match_summary(reference: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]],
                  eos_token_ids: Sequence[int] = ()) -> dict:
    """How far each request's ``outputs`` agree with ``reference``.

    Returns:
        ``same``: requests with identical token ids; ``first_mismatch``: per request, the first
        differing position (None when identical); ``first_mismatch_median``: the median of those
        positions over the differing requests (None when all are identical); ``differing_tokens``:
        per request, ``[reference token, other token]`` there (None where a side has ended);
        ``at_eos``: differing requests whose reference token there is one of ``eos_token_ids``
        (llama.cpp's ignore_eos bans EOS tokens, where pagedserve and vLLM only do not stop at them).
    """
    positions = [first_mismatch(r, o) for r, o in zip(reference, outputs, strict=True)]
    differing = [p for p in positions if p is not None]
    tokens = [None if p is None else [_token_at(r, p), _token_at(o, p)]
              for p, r, o in zip(positions, reference, outputs)]
    return {"same": len(positions) - len(differing), "first_mismatch": positions,
            "first_mismatch_median": statistics.median(differing) if differing else None,
            "differing_tokens": tokens, "at_eos": sum(1 for t in tokens if t and t[0] in eos_token_ids)}


def _token_at(ids: Sequence[int], position: int) -> int | None:
    return ids[position] if position < len(ids) else None


@dataclasses.dataclass(frozen=True)
class EngineVariant:
    """One pagedserve row of the table: its GEMM backend and compile mode."""

    gemm_backend: GemmBackend
    compile_mode: CompileMode

    @property
    def system(self) -> str:
        """``pagedserve``, then ``-torch`` / ``-onednn`` / ``-inductor`` for what differs from the defaults."""
        parts = ["pagedserve"]
        parts += [self.gemm_backend.value] if self.gemm_backend is not GemmBackend.AUTO else []
        parts += [self.compile_mode.value] if self.compile_mode is not CompileMode.EAGER else []
        return "-".join(parts)


def _engine_variants(text: str) -> list[EngineVariant]:
    """``torch,onednn+inductor`` -> the variants, in order."""
    variants = []
    for entry in text.split(","):
        gemm, _, compile_mode = entry.strip().partition("+")
        try:
            variants.append(EngineVariant(GemmBackend(gemm), CompileMode(compile_mode or "eager")))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected entries GEMM[+COMPILE] with GEMM in {[b.value for b in GemmBackend]} and COMPILE in "
                f"{[m.value for m in CompileMode]}, got {entry!r}") from None
    return variants


def run_pagedserve(model: Path, prompts: list[list[int]], requests: list[SampleRequest],
                   args: argparse.Namespace, variant: EngineVariant) -> SystemRun:
    """The in-process engine, after one warm-up request (and its compiling, for inductor); its memory
    is freed before the next system runs. The row is named by :attr:`EngineVariant.system`."""
    import gc

    from pagedserve.engine.models.onednn import resolve_gemm_backend
    from pagedserve.engine.sampling_params import SamplingParams

    llm = build_engine(model, argparse.Namespace(**{**vars(args), "gemm_backend": variant.gemm_backend.value,
                                                    "compile_mode": variant.compile_mode.value}))
    llm.add_request(WARMUP_TOKEN_IDS, SamplingParams(max_tokens=WARMUP_TOKENS, temperature=0.0, ignore_eos=True))
    while llm.has_unfinished_requests():
        llm.step()
    outputs: list[list[int]] = []
    run = time_engine(llm, prompts, requests, outputs)
    run = dataclasses.replace(run, system=variant.system)
    eos_token_ids = list(llm.tokenizer.info.eos_token_ids)
    max_decode_slowdown = llm.config.scheduler.max_decode_slowdown
    del llm
    gc.collect()
    info = {"dtype": args.dtype, "kv_cache_dtype": KVCacheDtype(args.kv_cache_dtype).value,
            "kv_cache_memory": args.kv_cache_memory,
            "eos_token_ids": eos_token_ids, "gemm_backend": variant.gemm_backend.value,
            "gemm_backend_resolved": resolve_gemm_backend(variant.gemm_backend, "cpu").value,
            "compile_mode": variant.compile_mode.value, "max_decode_slowdown": max_decode_slowdown,
            "admission_headroom": args.admission_headroom}
    return SystemRun(run, outputs, info)


def vllm_spec(model: Path, prompts: list[list[int]], requests: list[SampleRequest], args: argparse.Namespace) -> dict:
    """The vLLM driver's settings: pagedserve's limits, dtype and KV-cache dtype (vLLM's names are
    pagedserve's), a context that fits every request."""
    from pagedserve.units import parse_bytes

    longest = max(len(p) + r.expected_output_len for p, r in zip(prompts, requests))
    return {"model": str(model), "dtype": args.dtype, "kv_cache_dtype": KVCacheDtype(args.kv_cache_dtype).value,
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "max_model_len": max(2048, longest), "kv_cache_gib": kv_cache_gib(parse_bytes(args.kv_cache_memory)),
            "warmup_token_ids": WARMUP_TOKEN_IDS, "warmup_tokens": WARMUP_TOKENS,
            "engine_core": args.vllm_engine_core}


def table(runs: list[SystemRun], matches: dict[str, dict], n: int) -> str:
    """The result table: one row per system, pagedserve first; the ratio is to the fastest pagedserve row."""
    engine = fastest_pagedserve(runs)
    rows = []
    for s in runs:
        m = matches.get(s.run.system)
        same = f"{m['same']}/{n}" if m else "reference"
        rows.append([s.run.system, s.run.elapsed_s, s.run.output_tokens_per_s, s.run.total_tokens_per_s,
                     engine.output_tokens_per_s / s.run.output_tokens_per_s, same,
                     m["first_mismatch_median"] if m else None, m["at_eos"] if m else None])
    return format_table(["system", "elapsed s", "output tok/s", "total tok/s", "best pagedserve / it",
                         "same greedy ids", "first mismatch median", "of which at EOS"], rows)


def run(args: argparse.Namespace) -> int:
    return exit_on_peer_error("peers", _run, args)


def _run(args: argparse.Namespace) -> int:
    if args.vllm_python:  # fail before the long engine run (and torch's import), not after it
        check_vllm_python(args.vllm_python)
    if args.llama_server_url:
        llama_server_props(args.llama_server_url)
    from transformers import AutoTokenizer

    from pagedserve.model_files import resolve_model

    model = resolve_model(args.model or None)
    tokenizer = AutoTokenizer.from_pretrained(model)
    requests = sample_requests(dataset_spec_from_args(args), tokenizer)
    prompts = [tokenizer.encode(r.prompt) for r in requests]
    max_tokens = [r.expected_output_len for r in requests]
    print(f"{len(requests)} requests: {sum(map(len, prompts))} prompt tokens, {sum(max_tokens)} output tokens")
    systems = [lambda v=v: [run_pagedserve(model, prompts, requests, args, v)] for v in args.engines]
    if args.vllm_python:
        systems.append(lambda: run_vllm(args.vllm_python, vllm_spec(model, prompts, requests, args), prompts, max_tokens))
    if args.llama_server_url:
        systems.append(lambda: [run_llama_server(args.llama_server_url, prompts, max_tokens, WARMUP_TOKEN_IDS,
                                                 WARMUP_TOKENS)])
    rounds = run_rounds(systems, args.rounds)
    eos = rounds[0][0].info["eos_token_ids"]
    matches = [{s.run.system: match_summary(runs[0].outputs, s.outputs, eos) for s in runs[1:]} for runs in rounds]
    machine = machine_info()
    print(f"\nOffline throughput and greedy agreement, {args.dtype}, KV cache {KVCacheDtype(args.kv_cache_dtype).value} "
          f"({machine_line(machine)})")
    for i, (runs, round_matches) in enumerate(zip(rounds, matches)):
        if len(rounds) > 1:
            print(f"round {i + 1} of {len(rounds)}")
        print(table(runs, round_matches, len(requests)))
    if len(rounds) > 1:
        print(f"\nover the {len(rounds)} rounds\n{rounds_table(rounds)}")
    for s in rounds[0]:
        if s.run.output_tokens != sum(max_tokens):
            print(f"note: {s.run.system} generated {s.run.output_tokens} tokens, {sum(max_tokens)} asked for")
    if args.result_json:
        write_json(args.result_json, result(args, machine, rounds, matches, requests))
    return 0


def result(args: argparse.Namespace, machine: dict, rounds: list[list[SystemRun]], matches: list[dict[str, dict]],
           requests: list[SampleRequest]) -> dict:
    """Everything the run measured, for --result-json (tokens/s per second of wall time): ``systems``
    the first round's, ``rounds`` every round's (the first again), ``median_ratio`` per system."""
    by_round = [_systems(runs, round_matches) for runs, round_matches in zip(rounds, matches)]
    median_ratio = {s["system"]: statistics.median(r[i]["pagedserve_ratio"] for r in by_round)
                    for i, s in enumerate(by_round[0])}
    return {"num_requests": len(requests),
            "requests": [{"prompt_len": r.prompt_len, "output_len": r.expected_output_len} for r in requests],
            "systems": by_round[0], "rounds": by_round, "median_ratio": median_ratio,
            "settings": {k: str(v) for k, v in vars(args).items() if k != "func"}, "machine": machine}


def _systems(runs: list[SystemRun], matches: dict[str, dict]) -> list[dict]:
    engine = fastest_pagedserve(runs)
    return [{**vars(s.run), "output_tokens_per_s": s.run.output_tokens_per_s,
             "total_tokens_per_s": s.run.total_tokens_per_s,
             "pagedserve_ratio": engine.output_tokens_per_s / s.run.output_tokens_per_s,
             "info": s.info, "match": matches.get(s.run.system)} for s in runs]
