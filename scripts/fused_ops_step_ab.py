"""Issue #23: engine decode steps with the fused row-wise ops (models/csrc/fused_ops.cpp) against the
eager PyTorch forms, alternated in one process (this machine's speed drifts up to 1.5x within minutes,
so only a same-process A/B resolves a 10% change).

    python scripts/fused_ops_step_ab.py --batch 64 --context-len 256 [--dtype bfloat16] [--rounds 6] [--op silu_and_mul]

``--batch`` sequences of ``--context-len`` prompt tokens are prefilled and decoded a while (untimed);
then rounds of ``--steps`` decode steps alternate between the two forms (ABBA order), and the median
milliseconds per step of each are printed with their ratio. A measurement, not a test.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from pagedserve.engine.models import fused_ops, layers
from pagedserve.engine.models.decode_layers import DecodeLayers
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.llm import LLM


FUSED = fused_ops._fused


def _eager_silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def use_form(name: str, op: str, model: torch.nn.Module, loop: DecodeLayers | None) -> None:
    """Makes ``model`` run ``op`` ("all": every fused op; decode_layers: the C++ layer loop) fused or
    eager from the next step on."""
    if op == "all":
        fused_ops._fused = FUSED if name == "fused" else (lambda x: False)
    elif op == "silu_and_mul":
        layers.silu_and_mul = fused_ops.silu_and_mul if name == "fused" else _eager_silu_and_mul
    else:
        model.decode_layers = loop if name == "fused" else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64, help="decoding sequences (default 64)")
    parser.add_argument("--context-len", type=int, default=256, help="prompt tokens of each (default 256)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--rounds", type=int, default=6, help="timed rounds of each form (default 6)")
    parser.add_argument("--steps", type=int, default=4, help="decode steps a round (default 4)")
    parser.add_argument("--op", choices=("all", "silu_and_mul", "decode_layers"), default="all",
                        help="the ops the eager form runs eager (default all; silu_and_mul: that one alone; "
                             "decode_layers: the Python layers instead of models/decode_layers.py's C++ loop)")
    args = parser.parse_args()
    llm = LLM(None, dtype=args.dtype, kv_cache_memory="2GiB", max_num_seqs=args.batch,
              max_num_batched_tokens=2048, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=2 * args.rounds * (args.steps + 1) + 64, temperature=0.0, ignore_eos=True)
    for i in range(args.batch):
        llm.add_request([100 + (i * 7 + j) % 40000 for j in range(args.context_len)], params)
    for _ in range(args.batch * args.context_len // 2048 + 16):  # every prompt prefilled, then decoding
        llm.step()
    model = llm.engine.executor.runners["worker-0"].model
    loop = model.decode_layers
    ms: dict[str, list[float]] = {"fused": [], "eager": []}
    for r in range(args.rounds):
        for name in (("fused", "eager") if r % 2 == 0 else ("eager", "fused")):
            use_form(name, args.op, model, loop)
            llm.step()  # the first step of a form, untimed
            start = time.perf_counter()
            for _ in range(args.steps):
                llm.step()
            ms[name].append((time.perf_counter() - start) / args.steps * 1e3)
    use_form("fused", args.op, model, loop)
    for name, values in ms.items():
        print(f"{name}: median {statistics.median(values):.1f} ms/step  rounds {[round(v) for v in values]}")
    print(f"eager / fused: {statistics.median(ms['eager']) / statistics.median(ms['fused']):.3f}x "
          f"({args.batch} sequences, {args.context_len}-token prompts, {args.dtype}, ops: {args.op})")


if __name__ == "__main__":
    main()
