"""Issue #23: prefills of the default model with the CPU prefill attention op against torch's SDPA kernel,
alternated in one process (this machine's speed drifts up to 1.5x within minutes, so only a same-process
A/B resolves a few percent).

    PYTHONPATH=. python scripts/prefill_op_ab.py [--prompt-lens 128,512,1000] [--max-num-batched-tokens 256]
        [--dtype float32|bfloat16]

One offline engine (float32 unless ``--dtype``, the CPU's default token budget of 256 unless given: a longer prompt is
prefilled in chunks over its cached start), two prompts of each length, one output token; the baseline
rounds route prefills to the torch backend's path by replacing ``prefill_op_applies`` in the CPU backend
for that round (a measurement, not a test). Printed per length: milliseconds per prompt token of each
(best of ``--rounds`` alternated rounds), the ratio, and whether the greedy tokens agree.
"""

from __future__ import annotations

import argparse
import time

from pagedserve.engine.attention import cpu_backend
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.llm import LLM
from pagedserve.model_files import prepare_default_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt-lens", default="128,512,1000")
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = p.parse_args()
    llm = LLM(prepare_default_model(), kv_cache_memory="256MiB", enable_prefix_caching=False,
              max_num_batched_tokens=args.max_num_batched_tokens, dtype=args.dtype)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    with_op = cpu_backend.prefill_op_applies
    for n in map(int, args.prompt_lens.split(",")):
        prompts = [[(7 * i + 13 * j) % 40000 + 100 for j in range(n)] for i in range(2)]
        best, tokens = {}, {}
        for _ in range(args.rounds):
            for name, applies in (("torch", lambda query: False), ("op", with_op)):
                cpu_backend.prefill_op_applies = applies
                start = time.perf_counter()
                outputs = llm.generate(prompts, params)
                ms = (time.perf_counter() - start) / (2 * n) * 1e3
                best[name] = min(ms, best.get(name, ms))
                tokens[name] = [o.token_ids for o in outputs]
        cpu_backend.prefill_op_applies = with_op
        agree = "equal" if tokens["op"] == tokens["torch"] else "DIFFER"
        print(f"{n:5d} tokens: torch {best['torch']:.3f} ms/token, op {best['op']:.3f} ms/token, "
              f"x{best['torch'] / best['op']:.3f}; greedy tokens {agree}")


if __name__ == "__main__":
    main()
