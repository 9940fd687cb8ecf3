"""What `--short-prompt-share` gives short requests that arrive while a long prompt is prefilled: two in-process
engines (the share given, and 0: first come, first served; both with the services' `max_decode_slowdown` of 2)
alternated round by round (this VM's speed drifts within minutes). A measurement, not a test.

Each round: ``--streams`` greedy streams decode (random 32-token prompts, EOS ignored); once the engine has run
``--warm-steps`` steps (so that prefill chunks beside decodes are sized by its fitted step cost), one
``--long-prompt``-token prompt arrives, then a ``--short-prompt``-token prompt every ``--every`` steps, ``--shorts``
of them; the round ends at the long prompt's first token and the shorts' answers (1 token each). With
``--long-prompts 2`` two long prompts arrive together (the second waits for the first's chunks: the shorts pass
it). Printed per engine: the shorts' time to first token (median, largest), the long prompts', and the streams'
p99 gap while the first was prefilled.

    python scripts/short_prompt_ttft.py [--long-prompt 4000] [--long-prompts 1] [--shorts 5] [--every 4]
        [--rounds 2] [--share 0.5]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.llm import LLM
from pagedserve.model_files import resolve_model


def one_round(llm: LLM, args: argparse.Namespace, rng: random.Random) -> dict[str, list[float]]:
    """TTFTs (seconds) of the shorts and the long prompt, and the streams' gaps while it was prefilled."""
    def prompt(n: int) -> list[int]:
        return [rng.randrange(1000, 20000) for _ in range(n)]

    streams = [llm.add_request(prompt(32), SamplingParams(max_tokens=1024, temperature=0.0, ignore_eos=True))
               for _ in range(args.streams)]
    for _ in range(args.warm_steps):
        llm.step()
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    long_ids = [llm.add_request(prompt(args.long_prompt), one) for _ in range(args.long_prompts)]
    long_id, arrived = long_ids[0], {i: (time.perf_counter(), 0) for i in long_ids}
    first, last_token, gaps, step = {}, {}, [], 0
    while len(first) < len(arrived) or len(arrived) - len(long_ids) < args.shorts:
        step += 1
        if step % args.every == 0 and len(arrived) - len(long_ids) < args.shorts:
            arrived[llm.add_request(prompt(args.short_prompt), one)] = (time.perf_counter(), step)
        outputs, now = llm.step(), time.perf_counter()
        for out in outputs:
            if out.request_id in arrived and out.request_id not in first and out.delta.token_ids:
                first[out.request_id] = (now, step)
            elif out.request_id in streams and long_id not in first:
                gaps += [now - last_token[out.request_id]] if out.request_id in last_token else []
                last_token[out.request_id] = now
    for request_id in streams:
        llm.abort(request_id)
    ttft = {r: first[r][0] - t for r, (t, _) in arrived.items()}
    steps = [first[r][1] - s + 1 for r, (_, s) in arrived.items() if r not in long_ids]
    return {"short": [t for r, t in ttft.items() if r not in long_ids], "long": [ttft[r] for r in long_ids],
            "gaps": gaps, "short steps": steps, "long steps": [first[r][1] for r in long_ids]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model folder (default: the default model)")
    p.add_argument("--share", type=float, default=0.5, help="the short-prompt share measured against 0 (default %(default)s)")
    p.add_argument("--streams", type=int, default=8, help="decode streams (default %(default)s)")
    p.add_argument("--warm-steps", type=int, default=40, help="steps before the long prompt (default %(default)s)")
    p.add_argument("--long-prompt", type=int, default=4000, help="tokens of the long prompt (default %(default)s)")
    p.add_argument("--long-prompts", type=int, default=1, help="long prompts arriving together (default %(default)s)")
    p.add_argument("--short-prompt", type=int, default=40, help="tokens of each short prompt (default %(default)s)")
    p.add_argument("--shorts", type=int, default=5, help="short prompts a round (default %(default)s)")
    p.add_argument("--every", type=int, default=4, help="steps between short prompts (default %(default)s)")
    p.add_argument("--rounds", type=int, default=2, help="rounds per engine (default %(default)s)")
    args = p.parse_args()
    model = resolve_model(args.model)
    engines = {share: LLM(model, kv_cache_memory="1GiB", short_prompt_share=share, max_decode_slowdown=2.0)
               for share in (0.0, args.share)}  # the services' pacing: chunks beside decodes sized by time
    results: dict[float, dict[str, list[float]]] = {
        share: {key: [] for key in ("short", "long", "gaps", "short steps", "long steps")} for share in engines}
    for i in range(args.rounds):
        for share, llm in engines.items():
            for key, values in one_round(llm, args, random.Random(i)).items():
                results[share][key] += values
    for share, r in results.items():
        gaps = sorted(r["gaps"])
        print(f"share {share}: short TTFT s median {statistics.median(r['short']):.2f}, largest {max(r['short']):.2f} "
              f"(steps {r['short steps']}); long TTFT s {[round(t, 2) for t in r['long']]} (steps {r['long steps']}); "
              f"streams' gap p99 {gaps[int(0.99 * (len(gaps) - 1))]:.3f} s")


if __name__ == "__main__":
    main()
