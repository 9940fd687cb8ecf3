"""`pagedserve bench profile`: where one engine step's time goes, beside the GEMM floor.

For decode batches (default 1, 16, 64, 256 sequences of ``--context-len`` tokens) and one prefill
(default 512 tokens), the in-process engine runs a few timed steps with timers around each piece:
the model runner's phases (attention metadata, forward, logits, sampling, and the rest: plan
application and Python glue), and inside the forward the embedding, the norms, rotary, each GEMM
group (qkv, o, gate_up, down), the KV-cache write and attention. Beside them, the GEMM floors: the
same matmul shapes timed alone in the same run, with ``torch.mm`` (MKL, what ``F.linear`` runs),
with oneDNN on prepacked weights (``--gemm-backend onednn``) and, for float32 on CPUs with AVX2 and
FMA, with the panel GEMM (``--gemm-backend panels``): the least the step could cost with those GEMMs.
Times are milliseconds per step, medians over the timed steps.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pagedserve.config_flags import add_config_arguments, fields_except
from pagedserve.engine.runner_config import KERNELS, RunnerConfig, kernel_options
from pagedserve.bench.gemm_floor import gemm_floor_ms
from pagedserve.bench.machine import machine_info, machine_line
from pagedserve.engine.config import ATTENTION_BACKENDS

GEMMS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
PIECES = ("embed", "norm", "rotary", *GEMMS, "write_kv", "attention", "lm_head")


@dataclass(frozen=True)
class Window:
    """What the timers saw between two :meth:`StepTimers.take` calls: milliseconds per piece, and
    how many plans the runner executed."""

    ms: dict[str, float]
    plans: int


class StepTimers:
    """Wall-clock milliseconds per piece, accumulated until ``take`` (CPU work is synchronous).

    With overlap scheduling ``LLM.step`` can return before the plan it sent has started, so a window
    may hold no plan or two: :meth:`wrap_step` counts the plans started and finished, :meth:`take`
    waits until none runs and says how many the window holds (the profile runs one plan at a time,
    ``max_plans_in_flight=1``, and checks that each window holds one)."""

    def __init__(self) -> None:
        self.ms: dict[str, float] = defaultdict(float)
        self.running = 0
        self.plans = 0
        self._idle = threading.Condition()

    def wrap_step(self, fn: Callable) -> Callable:
        """``wrap("step", fn)`` that also counts the calls running and done (the runner's ``execute``)."""
        timed = self.wrap("step", fn)

        def counted(*args, **kwargs):
            with self._idle:
                self.running += 1
            try:
                return timed(*args, **kwargs)
            finally:
                with self._idle:
                    self.running -= 1
                    self.plans += 1
                    self._idle.notify_all()
        return counted

    def wrap(self, label: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.ms[label] += (time.perf_counter() - start) * 1000
        return timed

    def take(self, timeout_s: float = 60.0) -> Window:
        """The pieces and plans since the last take, once no step runs (up to ``timeout_s`` seconds)."""
        with self._idle:
            self._idle.wait_for(lambda: self.running == 0, timeout_s)
            window = Window(dict(self.ms), self.plans)
            self.ms, self.plans = defaultdict(float), 0
        return window


def instrument(runner, timers: StepTimers) -> None:
    """Puts timers around the runner's phases and the model's pieces. The attention-metadata
    builder is wrapped for the whole module: for a benchmark process, not a server. With a compiled
    forward the pieces inside the graph (embedding, norms, GEMMs) are not timed one by one: their
    time is the forward's less attention. Decode steps run the Python layers, whose pieces can be
    timed, not the C++ loop of ``models/decode_layers.py`` (the same kernels, one call: its steps are
    shorter by the Python time, see docs/benchmarks.md)."""
    from pagedserve.engine import forward_batch

    model = runner.model
    if runner.forward is model:
        _instrument_layers(model, timers)
        if hasattr(model, "decode_layers"):
            model.decode_layers = None
    backend = runner.attention_backend
    backend.write_kv = timers.wrap("write_kv", backend.write_kv)
    backend.attend = timers.wrap("attention", backend.attend)
    model.compute_logits = timers.wrap("lm_head", model.compute_logits)
    forward_batch.build_attention_metadata = timers.wrap("metadata", forward_batch.build_attention_metadata)
    runner._forward = timers.wrap("forward", runner._forward)
    sampler = runner.sampler
    runner.sampler = timers.wrap("sampling", sampler.__call__)
    runner.execute = timers.wrap_step(runner.execute)


def _instrument_layers(model, timers: StepTimers) -> None:
    """Timers around the embedding, rotary, norms and each GEMM group of an eager model."""
    model.embed_tokens.forward = timers.wrap("embed", model.embed_tokens.forward)
    model.rotary.forward = timers.wrap("rotary", model.rotary.forward)
    model.norm.forward = timers.wrap("norm", model.norm.forward)
    for layer in model.layers:
        layer.input_layernorm.forward = timers.wrap("norm", layer.input_layernorm.forward)
        layer.post_attention_layernorm.add_then_norm = timers.wrap("norm", layer.post_attention_layernorm.add_then_norm)
        for name, linear in (("qkv_proj", layer.self_attn.qkv_proj), ("o_proj", layer.self_attn.o_proj),
                             ("gate_up_proj", layer.mlp.gate_up_proj), ("down_proj", layer.mlp.down_proj)):
            linear.forward = timers.wrap(name, linear.forward)


def profile_case(llm, timers: StepTimers, batch: int, context_len: int, decode: bool, steps: int) -> dict:
    """Runs ``batch`` sequences to their decode phase (untimed), then times ``steps`` steps; for a
    prefill case, times the step that prefills one ``context_len``-token prompt.

    Raises:
        RuntimeError: the sequences were not all decoding after twice the ramp-up's steps and 8 more
            (preempted in turn: the KV cache holds too few blocks), or a step ran more than one plan.
    """
    from pagedserve.engine.sampling_params import SamplingParams

    # Long enough that no sequence finishes before every one is decoding; aborted afterwards.
    params = SamplingParams(max_tokens=steps + 2 * context_len + 64, temperature=0.0, ignore_eos=True)
    ids = [llm.add_request([100 + (i * 7 + j) % 40000 for j in range(context_len)], params) for i in range(batch)]
    if decode:
        limit = 2 * ramp_up_steps(llm, batch, context_len) + 8
        for _ in range(limit):
            if llm.stats().workers[0].num_running == batch and not llm.engine.scheduler.waiting_requests():
                break
            llm.step()
        else:
            raise RuntimeError(f"{batch} sequences were not all decoding after {limit} steps (preempted in turn?): "
                               "give more --kv-cache-memory")
        llm.step()  # the first decode step of everyone, untimed
    timers.take()
    per_step: list[dict[str, float]] = []
    for _ in range(steps if decode else 1):
        llm.step()
        window = timers.take()
        if window.plans != 1:
            raise RuntimeError(f"{window.plans} plans ran in one profiled step: the engine must run one plan a step "
                               "(max_plans_in_flight=1)")
        per_step.append(window.ms)
    for request_id in ids:
        llm.abort(request_id)
    llm.step()  # the workers drop the aborted sequences
    timers.take()
    keys = {k for s in per_step for k in s}
    return {k: statistics.median(s.get(k, 0.0) for s in per_step) for k in keys}


def ramp_up_steps(llm, batch: int, context_len: int) -> int:
    """About the steps that prefill ``batch`` prompts of ``context_len`` tokens (the decodes of those
    admitted first share the token budget, so a few more); the first sequences grow by a token in each."""
    return math.ceil(batch * context_len / llm.config.scheduler.max_num_batched_tokens) + 1


def run(args: argparse.Namespace) -> dict:
    """Profiles every case and returns the figures (printed as a table by ``main``)."""
    import torch

    from pagedserve.llm import LLM

    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(args.model or None, kv_cache_memory=args.kv_cache_memory, max_num_seqs=max(args.batches),
              max_num_batched_tokens=max(2048, args.prefill_len), enable_prefix_caching=False, max_plans_in_flight=1,
              admission_headroom=0.0,  # every case's batch decodes at once (the check below says it fits)
              dtype=args.dtype,
              **kernel_options(args), attention_backend=args.attention_backend)
    runner = llm.engine.executor.runners["worker-0"]
    timers = StepTimers()
    instrument(runner, timers)
    cases = [(f"decode x{b}", b, args.context_len, True) for b in args.batches]
    cases.append((f"prefill {args.prefill_len}", 1, args.prefill_len, False))
    for name, batch, context, _ in cases:
        growth = ramp_up_steps(llm, batch, context) + args.steps + 2
        check_cache_holds(llm, name, batch, context + growth, args.kv_cache_memory)
    results = {}
    for name, batch, context, decode in cases:
        print(f"  {name}: prefilling {batch} prompt(s) of {context} tokens, then {args.steps if decode else 1} timed "
              "step(s)", flush=True)
        pieces = profile_case(llm, timers, batch, context, decode, args.steps)
        rows = batch if decode else context
        pieces["gemm_floor"] = gemm_floor_ms(runner.model.config, rows, batch, args.dtype)
        results[name] = pieces
        print(f"  {name}: step {pieces.get('step', 0):.1f} ms", flush=True)
    return {"machine": machine_line(machine_info()), "threads": torch.get_num_threads(), "dtype": args.dtype,
            "cases": results}


def check_cache_holds(llm, name: str, batch: int, tokens: int, kv_cache_memory: str) -> None:
    """Exits with what to change when ``batch`` sequences of ``tokens`` tokens do not fit in the
    worker's KV cache at once: they would be preempted in turn and never all decode together, and
    the case would wait for them forever."""
    from pagedserve.engine.block_manager import blocks_for_tokens
    from pagedserve.units import parse_bytes

    cache = llm.stats().workers[0].num_blocks
    needed = batch * blocks_for_tokens(tokens, llm.config.scheduler.block_size)
    if needed > cache:
        enough = math.ceil(parse_bytes(kv_cache_memory) * needed / cache / 2**20)
        raise SystemExit(f"{name}: {batch} sequences of up to {tokens} tokens need {needed} KV blocks, the cache "
                         f"holds {cache}: give --kv-cache-memory {enough}MiB or more, or fewer --batches or "
                         "a shorter --context-len")


def format_table(report: dict) -> str:
    """Markdown: one column per case, one row per piece, then the GEMM floor and the ratio."""
    cases = report["cases"]
    header = "| ms per step | " + " | ".join(cases) + " |\n|---|" + "---:|" * len(cases) + "\n"
    rows = []
    for label in ("step", "metadata", "forward", *PIECES, "sampling"):
        rows.append(f"| {label} | " + " | ".join(f"{c.get(label, 0.0):.2f}" for c in cases.values()) + " |")
    rest = [c.get("step", 0) - sum(c.get(k, 0.0) for k in ("metadata", "forward", "lm_head", "sampling"))
            for c in cases.values()]
    rows.append("| rest of the step (plan, glue) | " + " | ".join(f"{r:.2f}" for r in rest) + " |")
    for floor in next(iter(cases.values()))["gemm_floor"]:
        values = [c["gemm_floor"][floor] for c in cases.values()]
        rows.append(f"| **GEMM floor** ({floor} alone) | " + " | ".join(f"{f:.2f}" for f in values) + " |")
        rows.append(f"| step / {floor} floor | " + " | ".join(
            f"{c.get('step', 0) / f:.2f}x" for c, f in zip(cases.values(), values)) + " |")
    return header + "\n".join(rows) + "\n"


def add_dtype_argument(p: argparse.ArgumentParser) -> None:
    """``--dtype`` of the profiles: float32 or bfloat16, both on the CPU."""
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="the model's weights and activations, and the GEMM floor's (default %(default)s); bfloat16 "
                        "needs a CPU with native bfloat16 (AVX512_BF16 or AMX)")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="per-step time breakdown of the engine beside the GEMM floor",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="", help="model folder (default: the default model)")
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 64, 256],
                   help="decode batch sizes, comma-separated (default 1,16,64,256)")
    p.add_argument("--context-len", type=int, default=64, help="tokens of each decoding sequence (default %(default)s)")
    p.add_argument("--prefill-len", type=int, default=512, help="tokens of the prefill case (default %(default)s)")
    p.add_argument("--steps", type=int, default=5, help="timed decode steps per case (default %(default)s)")
    add_dtype_argument(p)
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    p.add_argument("--kv-cache-memory", default="2GiB", help="KV-cache memory (default %(default)s)")
    add_config_arguments(p, RunnerConfig, exclude=fields_except(RunnerConfig, KERNELS))
    p.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="auto",
                   help="auto: the C++ op on CPU; torch: gathered copies and SDPA, as before it (default %(default)s)")
    p.add_argument("--result-json", default="", help="write every figure to this file")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    report = run(args)
    print(f"\n{report['machine']}, {report['threads']} torch threads, {report['dtype']}\n\n{format_table(report)}")
    if args.result_json:
        Path(args.result_json).write_text(json.dumps(report, indent=2))
    return 0
