"""Issue #23's diagnosis: one engine step at a time, pagedserve against vLLM on the same requests.

`bench peers` gives one figure per engine (output tokens/s over the whole run); this splits the run
into its steps. Each engine takes every request at once (greedy, EOS ignored, each its own output
length) and is stepped by hand; each step's wall time and the tokens it produced are recorded.
The table groups the steps by tokens produced (about the running decodes), so the same batch sizes
are compared: where the time goes, at which batch sizes an engine is slower per step.

    python scripts/step_trace.py requests --dataset-path D --num-prompts 64 --out req.json
    python scripts/step_trace.py pagedserve req.json ours.json [--dtype bfloat16]
    VLLM=/path/to/vllm-venv/bin/python
    $VLLM scripts/step_trace.py vllm req.json vllm.json [--dtype bfloat16]
    python scripts/step_trace.py table ours.json vllm.json

The vllm mode imports only vLLM and the standard library (run it with vLLM's interpreter); it runs
vLLM's engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so each ``step()`` is
one engine step, with the CPU settings of ``pagedserve/bench/vllm_driver.py``. Both engines get
the KV-cache dtype of ``--dtype`` (float32 keeps ``auto``), 256 sequences and 2048 tokens a step.
A measurement, not a test: run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import time
from pathlib import Path

BUCKET = 8  # tokens per step are grouped in ranges of this width


def make_requests(args: argparse.Namespace) -> None:
    """Samples ShareGPT requests as `bench peers` does and writes their prompt ids and lengths."""
    from transformers import AutoTokenizer

    from pagedserve.bench.datasets import DatasetSpec, sample_requests
    from pagedserve.model_files import resolve_model

    model = resolve_model(None)
    tokenizer = AutoTokenizer.from_pretrained(model)
    spec = DatasetSpec("sharegpt", args.dataset_path, args.num_prompts)
    requests = [{"prompt_token_ids": tokenizer.encode(r.prompt), "max_tokens": r.expected_output_len}
                for r in sample_requests(spec, tokenizer)]
    json.dump({"model": str(model), "requests": requests}, open(args.out, "w"))
    print(f"{len(requests)} requests, {sum(r['max_tokens'] for r in requests)} output tokens -> {args.out}")


def trace(step, has_unfinished) -> dict:
    """Steps until done: ``{"total_s": seconds, "steps": [[seconds, tokens produced], ...]}``;
    ``step()`` returns the tokens that step produced."""
    steps, start = [], time.perf_counter()
    while has_unfinished():
        t = time.perf_counter()
        produced = step()
        steps.append([time.perf_counter() - t, produced])
    return {"total_s": time.perf_counter() - start, "steps": steps}


def run_pagedserve(spec: dict, dtype: str, max_decode_slowdown: float) -> dict:
    from pagedserve.engine.sampling_params import SamplingParams
    from pagedserve.llm import LLM

    kv = {"kv_cache_dtype": dtype} if dtype != "float32" else {}
    llm = LLM(spec["model"], kv_cache_memory="2GiB", max_num_seqs=256, max_num_batched_tokens=2048, dtype=dtype,
              device="cpu", max_decode_slowdown=max_decode_slowdown, **kv)
    llm.add_request([1, 2, 3, 4], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))  # warm-up
    while llm.has_unfinished_requests():
        llm.step()
    for r in spec["requests"]:
        llm.add_request(r["prompt_token_ids"], SamplingParams(max_tokens=r["max_tokens"], temperature=0.0,
                                                              ignore_eos=True))
    return trace(lambda: sum(len(o.delta.token_ids) for o in llm.step()), llm.has_unfinished_requests)


def run_vllm(spec: dict, dtype: str) -> dict:
    """vLLM's engine, stepped, with ``vllm_driver.py``'s CPU settings (loaded by path: vLLM's
    interpreter has no pagedserve) and its engine core in this process."""
    driver_path = Path(__file__).resolve().parents[1] / "pagedserve" / "bench" / "vllm_driver.py"
    loader = importlib.util.spec_from_file_location("vllm_driver", driver_path)
    driver = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(driver)
    driver.set_cpu_environment(2, "in_process")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=spec["model"], dtype=dtype, kv_cache_dtype="auto" if dtype == "float32" else dtype,
              max_num_seqs=256, max_num_batched_tokens=2048, max_model_len=2048, seed=0)
    llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3, 4])],
                 SamplingParams(max_tokens=16, temperature=0, ignore_eos=True), use_tqdm=False)
    engine = llm.llm_engine
    for i, r in enumerate(spec["requests"]):
        engine.add_request(str(i), TokensPrompt(prompt_token_ids=r["prompt_token_ids"]),
                           SamplingParams(max_tokens=r["max_tokens"], temperature=0, ignore_eos=True))
    seen: dict[str, int] = {}

    def step() -> int:
        produced = 0
        for out in engine.step():  # cumulative outputs: count what is new
            n = len(out.outputs[0].token_ids)
            produced += n - seen.get(out.request_id, 0)
            seen[out.request_id] = n
        return produced

    return trace(step, engine.has_unfinished_requests)


def bucket(tokens: int) -> int:
    """The upper end of the range of ``tokens`` (steps producing more than 56 share the last one)."""
    return min(64, (tokens + BUCKET - 1) // BUCKET * BUCKET)


def table(paths: list[str]) -> None:
    """Steps grouped by tokens produced: count and ms per step for each trace, side by side."""
    traces = {p: json.load(open(p)) for p in paths}
    buckets = sorted({bucket(n) for t in traces.values() for _, n in t["steps"]})
    print("| tokens/step | " + " | ".join(f"{os.path.basename(p)} steps | ms/step" for p in paths) + " |")
    print("|---" * (1 + 2 * len(paths)) + "|")
    for b in buckets:
        cells = []
        for t in traces.values():
            times = [s for s, n in t["steps"] if bucket(n) == b]
            cells += [str(len(times)), f"{1000 * sum(times) / len(times):.1f}" if times else "-"]
        label = f"<= {b}" if b < 64 else "> 56"
        print(f"| {label} | " + " | ".join(cells) + " |")
    print("| whole run, s | " + " | ".join(f"{t['total_s']:.1f} | {len(t['steps'])} steps" for t in traces.values()) + " |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="mode", required=True)
    r = sub.add_parser("requests", help="sample the requests (pagedserve's interpreter)")
    r.add_argument("--dataset-path", required=True, type=Path)
    r.add_argument("--num-prompts", type=int, default=64)
    r.add_argument("--out", required=True)
    for mode in ("pagedserve", "vllm"):
        e = sub.add_parser(mode, help=f"trace {mode}'s steps")
        e.add_argument("requests")
        e.add_argument("out")
        e.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
        if mode == "pagedserve":
            e.add_argument("--max-decode-slowdown", type=float, default=2.0,
                           help="pagedserve's limit on a step with decodes against the decodes alone (default "
                                "%(default)s); inf fills each step's token budget with prefill chunks, as vLLM does")
    t = sub.add_parser("table", help="print the traces side by side")
    t.add_argument("traces", nargs="+")
    args = p.parse_args()
    if args.mode == "requests":
        make_requests(args)
    elif args.mode == "table":
        table(args.traces)
    else:
        spec = json.load(open(args.requests))
        result = (run_pagedserve(spec, args.dtype, args.max_decode_slowdown) if args.mode == "pagedserve"
                  else run_vllm(spec, args.dtype))
        json.dump(result, open(args.out, "w"))
        print(f"{args.mode} {args.dtype}: {result['total_s']:.1f} s, {len(result['steps'])} steps -> {args.out}")


if __name__ == "__main__":
    main()
