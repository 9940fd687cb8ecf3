"""What `--speculative-control goodput` gives against plain decoding and against verifying every draft (`fixed`,
vLLM's behaviour), n-gram drafts, k = 4: three in-process engines loaded once and alternated workload by workload
(this VM's speed drifts within minutes), output tokens/s. A measurement, not a test.

Workloads: `busy`, the ShareGPT requests all at once, each its own output length with EOS ignored (as `bench
throughput`); `mixed`, the same with a quarter of them replaced by copy requests (each as long as the answer it
repeats); `copy`, requests one at a time that repeat a ShareGPT answer word for word (128 tokens, EOS
respected); `chat`, ShareGPT first turns one at a time (128 tokens, EOS respected). Greedy ids are compared
with plain decoding's (they must be equal).

    python scripts/speculation_ab.py --dataset-path $D [--num-prompts 64] [--rounds 2] [--one-at-a-time 4]
        [--workloads busy,mixed,copy,chat] [--engines none,fixed,goodput] [--max-plans-in-flight 2]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from transformers import AutoTokenizer

from pagedserve.bench.datasets import DatasetSpec, sample_requests
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.llm import LLM
from pagedserve.model_files import resolve_model

ENGINES = {"none": {"method": "none"}, "fixed": {"method": "ngram", "control": "fixed", "num_speculative_tokens": 4},
           "goodput": {"method": "ngram", "control": "goodput", "num_speculative_tokens": 4}}


def copy_prompt(answer: str) -> str:
    """A request to repeat ``answer`` word for word (the copy and mixed workloads' prompt)."""
    return f"Repeat the following text exactly, word for word:\n{answer}\n\nRepeated text:\n"


def busy(llm: LLM, prompts: list[list[int]], lengths: list[int]) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    outputs = llm.generate(prompts, [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths])
    return time.perf_counter() - start, [list(o.samples[0].token_ids) for o in outputs]


def one_at_a_time(llm: LLM, prompts: list[list[int]]) -> tuple[float, list[list[int]]]:
    start, ids = time.perf_counter(), []
    for prompt in prompts:
        ids.append(list(llm.generate(prompt, SamplingParams(max_tokens=128, temperature=0.0))[0].samples[0].token_ids))
    return time.perf_counter() - start, ids


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model folder (default: the default model)")
    p.add_argument("--dataset-path", type=Path, required=True, help="the ShareGPT JSON file")
    p.add_argument("--num-prompts", type=int, default=64, help="requests of the busy workload (default %(default)s)")
    p.add_argument("--one-at-a-time", type=int, default=4, help="requests of copy and chat (default %(default)s)")
    p.add_argument("--rounds", type=int, default=2, help="rounds over the engines (default %(default)s)")
    p.add_argument("--max-plans-in-flight", type=int, default=2, help="1: no overlap scheduling (default %(default)s)")
    p.add_argument("--engines", default="none,fixed,goodput", help="comma-separated, none first (default %(default)s)")
    p.add_argument("--workloads", default="busy,mixed,copy,chat", help="comma-separated (default %(default)s)")
    args = p.parse_args()
    model = resolve_model(args.model)
    engines = {name: LLM(model, speculative_config=ENGINES[name],
                         max_plans_in_flight=args.max_plans_in_flight) for name in args.engines.split(",")}
    tokenizer = AutoTokenizer.from_pretrained(model)
    requests = sample_requests(DatasetSpec("sharegpt", args.dataset_path, args.num_prompts), tokenizer)
    answers = [c["conversations"][1]["value"] for c in json.loads(args.dataset_path.read_text())
               if len(c.get("conversations", [])) > 1 and 300 <= len(c["conversations"][1]["value"]) <= 1500]
    copied = [tokenizer.encode(a) for a in answers[:max(1, args.num_prompts // 4)]]
    copies = [tokenizer.encode(copy_prompt(a)) for a in answers[:len(copied)]]
    workloads = {
        "busy": lambda llm: busy(llm, [tokenizer.encode(r.prompt) for r in requests],
                                 [r.expected_output_len for r in requests]),
        "mixed": lambda llm: busy(llm, [tokenizer.encode(r.prompt) for r in requests[:-len(copies)]] + copies,
                                  [r.expected_output_len for r in requests[:-len(copies)]] + [len(c) for c in copied]),
        "copy": lambda llm: one_at_a_time(llm, [tokenizer.encode(copy_prompt(a))
                                                for a in answers[:args.one_at_a_time]]),
        "chat": lambda llm: one_at_a_time(llm, [tokenizer.encode(r.prompt) for r in requests[:args.one_at_a_time]]),
    }
    for name in args.workloads.split(","):
        for round_ in range(1, args.rounds + 1):
            results = {engine: workloads[name](llm) for engine, llm in engines.items()}
            rates = {e: sum(map(len, ids)) / seconds for e, (seconds, ids) in results.items()}
            same = all(ids == results["none"][1] for _, ids in results.values())
            print(f"{name} round {round_}: " + ", ".join(f"{e} {r:.1f} tok/s" for e, r in rates.items()) + "; "
                  + ", ".join(f"{e} / none {r / rates['none']:.3f}" for e, r in rates.items() if e != "none")
                  + f"; greedy ids equal: {same}", flush=True)


if __name__ == "__main__":
    main()
