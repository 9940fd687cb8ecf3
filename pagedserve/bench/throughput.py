"""`pagedserve bench throughput`: offline output tokens/s, our engine vs Hugging Face static batching.

Both run the same prompts on the same model, dtype and machine, in one run. As in vLLM's throughput
benchmark every request generates exactly its own output length with EOS ignored. The baseline is
`transformers` `generate` over static batches in arrival order (left padding, greedy): each batch
runs to the longest output in it, and only each request's own tokens count. The best of the
batch sizes tried is the baseline.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from pagedserve.config_flags import add_config_arguments, config_from_args, fields_except
from pagedserve.engine.config import SchedulerConfig
from pagedserve.engine.spec_decode.config import SpeculativeConfig
from pagedserve.engine.runner_config import KERNELS, RunnerConfig, kernel_options
from pagedserve.bench.datasets import SampleRequest, add_dataset_arguments, dataset_spec_from_args, sample_requests
from pagedserve.bench.machine import machine_info, machine_line


@dataclass(frozen=True)
class ThroughputRun:
    """One system's pass over the prompts.

    Attributes:
        system: ``pagedserve`` or ``hf-b<batch size>``.
        elapsed_s: wall time of the pass, seconds.
        output_tokens: the requests' own output tokens.
        prompt_tokens: the requests' prompt tokens.
    """

    system: str
    elapsed_s: float
    output_tokens: int
    prompt_tokens: int

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    @property
    def total_tokens_per_s(self) -> float:
        return (self.output_tokens + self.prompt_tokens) / self.elapsed_s


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "throughput", help="offline output tokens/s: the in-process engine vs transformers static batching",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="", help="model folder (default: the default model)")
    add_dataset_arguments(p)
    p.add_argument("--hf-batch-sizes", default="8,16,32", help="static batch sizes for transformers (default %(default)s)")
    p.add_argument("--skip-hf", action="store_true", help="run only the engine (no baseline, no ratio)")
    p.add_argument("--device", default="cpu", help="torch device for both systems: cpu or cuda (default %(default)s)")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                   help="dtype for both systems; auto: bfloat16 on CUDA, float32 on CPU (default %(default)s)")
    add_engine_arguments(p)
    add_config_arguments(p, RunnerConfig, exclude=fields_except(RunnerConfig, KERNELS))
    add_config_arguments(p.add_argument_group("speculative decoding"), SpeculativeConfig)
    p.add_argument("--result-json", type=Path, help="write every figure here")
    p.set_defaults(func=run)


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """The in-process engine's limits, shared with `bench peers`."""
    p.add_argument("--kv-cache-memory", default="2GiB", help="engine KV-cache memory (default %(default)s)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="engine: most running sequences (default %(default)s)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="engine: tokens per iteration (default %(default)s)")
    add_plans_in_flight_argument(p)


def add_plans_in_flight_argument(p: argparse.ArgumentParser) -> None:
    """``--max-plans-in-flight`` and ``--admission-headroom`` of the in-process engine (read by
    :func:`build_engine`)."""
    p.add_argument("--max-plans-in-flight", type=int, default=2,
                   help="engine: 2 overlaps scheduling with the model's step, 1 does not (default %(default)s)")
    add_config_arguments(p, SchedulerConfig, exclude=fields_except(SchedulerConfig, frozenset({"admission_headroom"})))


def build_engine(model: Path, args: argparse.Namespace, **options):
    """The in-process engine (``pagedserve.llm.LLM``) with the limits, dtype and device in ``args``,
    and any other ``LLM`` options (``enable_prefix_caching=False``)."""
    from pagedserve.llm import LLM

    return LLM(model, kv_cache_memory=args.kv_cache_memory, max_num_seqs=args.max_num_seqs,
               max_num_batched_tokens=args.max_num_batched_tokens, dtype=args.dtype, device=args.device,
               **kernel_options(args), max_plans_in_flight=args.max_plans_in_flight,
               admission_headroom=args.admission_headroom, **options)


def time_engine(llm, prompts: list[list[int]], requests: list[SampleRequest],
                outputs: list[list[int]] | None = None, structured_output=None) -> ThroughputRun:
    """All requests submitted at once to ``llm`` (greedy, EOS ignored, each its own output length);
    wall time until the last one finishes, seconds. ``outputs``, when given, receives each request's
    generated token ids, in request order; ``structured_output`` (a ``StructuredOutput``), when
    given, constrains every request."""
    from tqdm import tqdm

    from pagedserve.engine.sampling_params import SamplingParams

    total = sum(r.expected_output_len for r in requests)
    generated: dict[str, list[int]] = {}
    with tqdm(total=total, desc="pagedserve", unit="tok") as bar:
        start = time.perf_counter()
        order = [llm.add_request(ids, SamplingParams(max_tokens=r.expected_output_len, temperature=0.0,
                                                     ignore_eos=True, structured_output=structured_output)) for ids, r in zip(prompts, requests)]
        produced = 0
        while llm.has_unfinished_requests():
            for item in llm.step():
                generated.setdefault(item.request_id, []).extend(item.delta.token_ids)
                produced += len(item.delta.token_ids)
                bar.update(len(item.delta.token_ids))
        elapsed = time.perf_counter() - start
    assert produced == total, f"engine produced {produced} tokens, expected {total}"
    if outputs is not None:
        outputs.extend(generated.get(request_id, []) for request_id in order)
    return ThroughputRun("pagedserve", elapsed, total, sum(len(p) for p in prompts))


# On CUDA each system first runs the first requests untimed (16 output tokens each): Triton compiles a
# kernel variant at its first launch (1-2 s each: prefill tile sizes, split decode) and cuBLAS makes its
# handles, a start-up cost that a served model pays once, not per run.
WARM_UP_REQUESTS = 16


def warm_up(run) -> None:
    started = time.perf_counter()
    run()
    print(f"warm-up (untimed): {time.perf_counter() - started:.1f} s")


def run_engine(model: Path, requests: list[SampleRequest], args: argparse.Namespace, tokenizer) -> ThroughputRun:
    """All requests submitted at once to the in-process engine; time until the last one finishes
    (with speculative decoding: its mean accepted length printed)."""
    llm = build_engine(model, args, speculative_config=config_from_args(SpeculativeConfig, args))
    prompts = [tokenizer.encode(r.prompt) for r in requests]
    if args.device.startswith("cuda"):
        # reversed prompts: the same lengths, no prefix-cache hits for the timed run
        warm_up(lambda: time_engine(llm, [p[::-1] for p in prompts[:WARM_UP_REQUESTS]], [
            replace(r, expected_output_len=min(r.expected_output_len, 16)) for r in requests[:WARM_UP_REQUESTS]]))
    before = llm.stats().spec_decode  # the warm-up's, not counted
    run = time_engine(llm, prompts, requests)
    counters = llm.stats().spec_decode
    if counters is not None and before is not None:
        counters -= before
    if counters is not None and counters.num_drafts:
        print(f"speculative decoding: {counters.num_draft_tokens} drafts, {counters.num_accepted_tokens} accepted "
              f"{counters.num_accepted_tokens_per_pos} by position, mean accepted length {counters.mean_accepted_length:.2f}")
    return run


def run_hf(model_dir: Path, requests: list[SampleRequest], batch_size: int, tokenizer,
           args: argparse.Namespace) -> ThroughputRun:
    """transformers generate over static batches in arrival order; left padding, greedy, EOS ignored."""
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    from pagedserve.engine.runner_factory import resolve_dtype

    dtype = getattr(torch, resolve_dtype(args.dtype, args.device))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(args.device).eval()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    tokenizer.padding_side = "left"

    def generate(batch: list[SampleRequest], longest: int) -> None:
        enc = tokenizer([r.prompt for r in batch], return_tensors="pt", padding=True).to(args.device)
        with torch.inference_mode():
            model.generate(**enc, max_new_tokens=longest, min_new_tokens=longest, do_sample=False,
                           pad_token_id=pad)

    if args.device.startswith("cuda"):
        warm_up(lambda: generate(requests[:min(batch_size, WARM_UP_REQUESTS)], 16))
    start = time.perf_counter()
    for i in tqdm(range(0, len(requests), batch_size), desc=f"transformers b={batch_size}", unit="batch"):
        batch = requests[i:i + batch_size]
        generate(batch, max(r.expected_output_len for r in batch))
    elapsed = time.perf_counter() - start
    return ThroughputRun(f"hf-b{batch_size}", elapsed, sum(r.expected_output_len for r in requests),
                         sum(r.prompt_len for r in requests))


def print_table(runs: list[ThroughputRun], best_hf: ThroughputRun | None, engine: ThroughputRun, info: dict) -> None:
    print(f"\nOffline throughput ({machine_line(info)})")
    print(f"{'system':<12} {'elapsed s':>10} {'output tok/s':>13} {'total tok/s':>12}")
    for r in runs:
        print(f"{r.system:<12} {r.elapsed_s:>10.1f} {r.output_tokens_per_s:>13.1f} {r.total_tokens_per_s:>12.1f}")
    if best_hf is not None:
        ratio = engine.output_tokens_per_s / best_hf.output_tokens_per_s
        print(f"ratio pagedserve / best transformers ({best_hf.system}): {ratio:.2f}x")


def run(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from pagedserve.model_files import resolve_model

    model = resolve_model(args.model or None)
    tokenizer = AutoTokenizer.from_pretrained(model)
    requests = sample_requests(dataset_spec_from_args(args), tokenizer)
    print(f"{len(requests)} requests: {sum(r.prompt_len for r in requests)} prompt tokens, "
          f"{sum(r.expected_output_len for r in requests)} output tokens")
    engine = run_engine(model, requests, args, tokenizer)
    runs = [engine]
    if not args.skip_hf:
        runs += [run_hf(model, requests, int(b), tokenizer, args) for b in args.hf_batch_sizes.split(",")]
    hf_runs = runs[1:]
    best_hf = max(hf_runs, key=lambda r: r.output_tokens_per_s) if hf_runs else None
    info = machine_info()
    print_table(runs, best_hf, engine, info)
    if args.result_json:
        result = {
            "engine_output_tokens_per_s": engine.output_tokens_per_s,
            "hf_output_tokens_per_s": best_hf.output_tokens_per_s if best_hf else None,
            "ratio": engine.output_tokens_per_s / best_hf.output_tokens_per_s if best_hf else None,
            "hf_best_batch_size": int(best_hf.system[4:]) if best_hf else None,
            "runs": [{**asdict(r), "output_tokens_per_s": r.output_tokens_per_s,
                      "total_tokens_per_s": r.total_tokens_per_s} for r in runs],
            "settings": {k: str(v) for k, v in vars(args).items() if k != "func"},
            "machine": info,
        }
        args.result_json.write_text(json.dumps(result, indent=2) + "\n")
    return 0
