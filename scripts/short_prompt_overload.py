"""What `--short-prompt-share` costs under overload: one in-process engine per run (two engines in one process
slowed each other), the same work each time: ``--long-prompts`` prompts of ``--long-prompt`` tokens, then a
10-40-token prompt every step from step 5, ``--shorts`` of them, 4 greedy tokens each (EOS ignored), the token
budget ``--budget``. Printed: wall time and steps to finish it all, the short prompts' wait for their first
token in steps (median, largest), the long prompts' TTFT. A measurement, not a test; alternate the shares in
separate runs (this VM's speed drifts within minutes):

    for s in 0 0.5 0 0.5; do python scripts/short_prompt_overload.py --share $s; done
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.llm import LLM
from pagedserve.model_files import resolve_model


def one_run(llm: LLM, args: argparse.Namespace, seed: int) -> str:
    rng = random.Random(seed)
    four = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    longs = [llm.add_request([rng.randrange(1000, 20000) for _ in range(args.long_prompt)], four)
             for _ in range(args.long_prompts)]
    arrived, first, done, step = {}, {}, set(), 0
    while len(done) < len(longs) + args.shorts:
        step += 1
        if step >= 5 and len(arrived) < args.shorts:
            prompt = [rng.randrange(1000, 20000) for _ in range(rng.randint(10, 40))]
            arrived[llm.add_request(prompt, four)] = step
        for out in llm.step():
            if out.delta.token_ids and out.request_id not in first:
                first[out.request_id] = (step, time.perf_counter() - start)
            if out.delta.finish_reason:
                done.add(out.request_id)
    waits = [first[r][0] - s for r, s in arrived.items()]
    ttfts = [round(first[r][1], 2) for r in longs]
    return (f"wall {time.perf_counter() - start:.1f} s, steps {step}, short prompts' wait in steps median "
            f"{statistics.median(waits)} largest {max(waits)}, long prompts' TTFT s {ttfts}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model folder (default: the default model)")
    p.add_argument("--share", type=float, default=0.5, help="--short-prompt-share (default %(default)s)")
    p.add_argument("--max-decode-slowdown", type=float, default=2.0, help="the pacing (default %(default)s)")
    p.add_argument("--budget", type=int, default=32, help="max_num_batched_tokens (default %(default)s)")
    p.add_argument("--long-prompt", type=int, default=800, help="tokens of each long prompt (default %(default)s)")
    p.add_argument("--long-prompts", type=int, default=2, help="long prompts (default %(default)s)")
    p.add_argument("--shorts", type=int, default=100, help="short prompts, one a step (default %(default)s)")
    p.add_argument("--rounds", type=int, default=2, help="runs, each with its own prompts (default %(default)s)")
    args = p.parse_args()
    llm = LLM(resolve_model(args.model), kv_cache_memory="1GiB", short_prompt_share=args.share,
              max_decode_slowdown=args.max_decode_slowdown, max_num_batched_tokens=args.budget)
    for i in range(args.rounds):
        print(f"share {args.share} round {i}: {one_run(llm, args, 20 + 10 * i)}", flush=True)


if __name__ == "__main__":
    main()
