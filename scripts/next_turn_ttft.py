"""What `--prefix-cache-outputs own` costs a chat: the time to the first token of a next turn (the first prompt,
its answer and a new message, as token ids) with the answer's blocks shared (the default) and with them kept
to their own sequence (the next turn prefills the answer again), two in-process engines alternated turn by
turn (this VM's speed drifts within minutes). A measurement, not a test.

    python scripts/next_turn_ttft.py [--model PATH] [--prompt-len 200] [--answer-len 256] [--turns 6]
"""

from __future__ import annotations

import argparse
import statistics
import time

from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.llm import LLM
from pagedserve.model_files import resolve_model


def next_turn_ms(llm: LLM, trial: int, prompt_len: int, answer_len: int) -> float:
    """Milliseconds to the first token of trial ``trial``'s next turn (its first turn answered before)."""
    first = [(13 * j + 7 * trial) % 40000 + 100 for j in range(prompt_len)]
    answer = llm.generate(first, SamplingParams(max_tokens=answer_len, temperature=0.0, ignore_eos=True))[0]
    turn = first + list(answer.samples[0].token_ids) + [(7 * j + trial) % 30000 + 200 for j in range(32)]
    start = time.perf_counter()
    llm.generate(turn, SamplingParams(max_tokens=1, temperature=0.0))
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model folder (default: the default model)")
    p.add_argument("--prompt-len", type=int, default=200, help="first prompt's tokens (default %(default)s)")
    p.add_argument("--answer-len", type=int, default=256, help="its answer's tokens (default %(default)s)")
    p.add_argument("--turns", type=int, default=6, help="next turns timed per engine (default %(default)s)")
    args = p.parse_args()
    model = resolve_model(args.model)
    engines = {mode: LLM(model, kv_cache_memory="256MiB", prefix_cache_outputs=mode) for mode in ("shared", "own")}
    times: dict[str, list[float]] = {mode: [] for mode in engines}
    for trial in range(args.turns + 1):  # the first, a warm-up, is not counted
        for mode, llm in engines.items():
            ms = next_turn_ms(llm, trial, args.prompt_len, args.answer_len)
            if trial:
                times[mode].append(ms)
    for mode, llm in engines.items():
        print(f"{mode:6s} next-turn TTFT ms {[round(t) for t in times[mode]]} median "
              f"{statistics.median(times[mode]):.0f}, prefix-cache hit tokens {llm.stats().prefix_cache_hits}")
    print(f"own / shared: {statistics.median(times['own']) / statistics.median(times['shared']):.2f}x")


if __name__ == "__main__":
    main()
