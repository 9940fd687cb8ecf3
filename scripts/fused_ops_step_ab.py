"""Issue #23: engine decode steps with the fused row-wise ops (models/csrc/fused_ops.cpp) against the
eager PyTorch forms, alternated in one process (this machine's speed drifts up to 1.5x within minutes,
so only a same-process A/B resolves a 10% change).

    python scripts/fused_ops_step_ab.py --batch 64 --context-len 256 [--dtype bfloat16] [--rounds 6]

``--batch`` sequences of ``--context-len`` prompt tokens are prefilled and decoded a while (untimed);
then rounds of ``--steps`` decode steps alternate between the two forms (ABBA order), and the median
milliseconds per step of each are printed with their ratio. A measurement, not a test.
"""

from __future__ import annotations

import argparse
import statistics
import time

from pagedserve.engine.models import fused_ops
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.llm import LLM


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64, help="decoding sequences (default 64)")
    parser.add_argument("--context-len", type=int, default=256, help="prompt tokens of each (default 256)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--rounds", type=int, default=6, help="timed rounds of each form (default 6)")
    parser.add_argument("--steps", type=int, default=4, help="decode steps a round (default 4)")
    args = parser.parse_args()
    llm = LLM(None, dtype=args.dtype, kv_cache_memory="2GiB", max_num_seqs=args.batch,
              max_num_batched_tokens=2048, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=2 * args.rounds * (args.steps + 1) + 64, temperature=0.0, ignore_eos=True)
    for i in range(args.batch):
        llm.add_request([100 + (i * 7 + j) % 40000 for j in range(args.context_len)], params)
    for _ in range(args.batch * args.context_len // 2048 + 16):  # every prompt prefilled, then decoding
        llm.step()
    fused = fused_ops._fused
    forms = {"fused": fused, "eager": lambda x: False}
    ms: dict[str, list[float]] = {name: [] for name in forms}
    for r in range(args.rounds):
        for name in (("fused", "eager") if r % 2 == 0 else ("eager", "fused")):
            fused_ops._fused = forms[name]
            llm.step()  # the first step of a form, untimed
            start = time.perf_counter()
            for _ in range(args.steps):
                llm.step()
            ms[name].append((time.perf_counter() - start) / args.steps * 1e3)
    fused_ops._fused = fused
    for name, values in ms.items():
        print(f"{name}: median {statistics.median(values):.1f} ms/step  rounds {[round(v) for v in values]}")
    print(f"eager / fused: {statistics.median(ms['eager']) / statistics.median(ms['fused']):.3f}x "
          f"({args.batch} sequences, {args.context_len}-token prompts, {args.dtype})")


if __name__ == "__main__":
    main()
