"""`pagedserve bench prefill-attention`: the CPU prefill attention op against torch's kernel, same run.

One sequence's prefill attention per prompt length, float32, the default model's heads (9 query, 3
KV, 64 channels): the C++ op (``attention/csrc/prefill_attention_cpu.cpp``) and, as the baseline, the
torch backend's path (``scaled_dot_product_attention``, causal), alternated round by round on the same
inputs; with ``--context-len`` the prompt follows that many cached positions (a chunked prefill or a
prefix-cache hit). GFLOP/s counts the causal products only: ``4 x D x H`` per (query, readable key)
pair. Medians of ``--rounds`` rounds; the ratio is the baseline's time over the op's.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from pagedserve.bench.attention_op import median_ms
from pagedserve.bench.machine import machine_info, machine_line
from pagedserve.bench.report import format_table
from pagedserve.units import positive


@dataclass(frozen=True)
class PrefillTiming:
    """One prompt length's prefill attention (one layer).

    Attributes:
        prompt_len: new tokens; ``context_len`` cached positions before them.
        torch_ms, op_ms: median time of one call, milliseconds.
        torch_gflops, op_gflops: causal GFLOP per call over the time, 10^9 per second.
        speedup: ``torch_ms / op_ms``.
    """

    prompt_len: int
    context_len: int
    torch_ms: float
    op_ms: float
    torch_gflops: float
    op_gflops: float
    speedup: float


def _head_dim(text: str) -> int:
    from pagedserve.engine.attention.prefill_op import HEAD_DIM_MULTIPLE  # torch: only when the command runs

    value = positive(int)(text)
    if value % HEAD_DIM_MULTIPLE:
        raise argparse.ArgumentTypeError(f"must be a multiple of {HEAD_DIM_MULTIPLE} (the op's panels), got {text}")
    return value


def _prompt_lens(text: str) -> list[int]:
    try:
        return [positive(int)(n) for n in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated positive integers, got {text!r}") from None


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("prefill-attention", help="the CPU prefill attention op vs torch's SDPA, per prompt length",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt-lens", type=_prompt_lens, default=[128, 512, 1000, 2000],
                   help="comma-separated new tokens per prefill (default 128,512,1000,2000)")
    p.add_argument("--context-len", type=_non_negative, default=0,
                   help="cached positions before each prompt, 0 or more (default %(default)s)")
    p.add_argument("--num-heads", type=positive(int), default=9, help="query heads (default %(default)s)")
    p.add_argument("--num-kv-heads", type=positive(int), default=3,
                   help="KV heads, a divisor of --num-heads (default %(default)s)")
    p.add_argument("--head-dim", type=_head_dim, default=64, help="channels per head (default %(default)s)")
    p.add_argument("--rounds", type=positive(int), default=7,
                   help="timed rounds per length and kernel (default %(default)s)")
    p.add_argument("--result-json", type=Path, help="write every figure here")
    p.set_defaults(func=run)


def measure(args: argparse.Namespace, prompt_len: int) -> PrefillTiming:
    """Both kernels on one random prompt of ``prompt_len`` tokens after ``args.context_len`` positions.

    Raises:
        RuntimeError: the op cannot be built or run here (from ``prefill_attention``).
    """
    import torch

    from pagedserve.engine.attention.prefill_op import prefill_attention
    from pagedserve.engine.attention.torch_backend import sdpa_prefill

    g = torch.Generator().manual_seed(prompt_len)
    length = args.context_len + prompt_len
    query = torch.randn(prompt_len, args.num_heads, args.head_dim, generator=g)
    key, value = (torch.randn(length, args.num_kv_heads, args.head_dim, generator=g) for _ in range(2))
    scale = args.head_dim ** -0.5
    repeats = max(1, 2_000_000 // (prompt_len * length))
    times = {"torch": [], "op": []}
    for _ in range(args.rounds):  # alternated, so that both see the same machine
        times["torch"].append(median_ms(lambda i: sdpa_prefill(query, key, value, scale), repeats, 1))
        times["op"].append(median_ms(lambda i: prefill_attention(query, key, value, scale), repeats, 1))
    torch_ms, op_ms = (sorted(t)[len(t) // 2] for t in (times["torch"], times["op"]))
    pairs = prompt_len * args.context_len + prompt_len * (prompt_len + 1) // 2
    gflop = 4 * args.head_dim * args.num_heads * pairs / 1e9
    return PrefillTiming(prompt_len, args.context_len, torch_ms, op_ms, gflop / torch_ms * 1e3, gflop / op_ms * 1e3,
                         torch_ms / op_ms)


def run(args: argparse.Namespace) -> int:
    import torch

    if args.num_heads % args.num_kv_heads:
        raise SystemExit(f"--num-heads {args.num_heads} is not a multiple of --num-kv-heads {args.num_kv_heads}")
    timings = [measure(args, n) for n in args.prompt_lens]
    title = (f"prefill attention, float32, H{args.num_heads}/{args.num_kv_heads} D{args.head_dim}, "
             f"{args.context_len} cached positions, {torch.get_num_threads()} threads")
    rows = [(t.prompt_len, t.torch_ms, t.torch_gflops, t.op_ms, t.op_gflops, t.speedup) for t in timings]
    print(format_table(("prompt tokens", "torch SDPA ms", "GFLOP/s", "op ms", "GFLOP/s", "x torch's speed"), rows,
                       title))
    info = machine_info()
    print(machine_line(info))
    if args.result_json:
        args.result_json.write_text(json.dumps({"timings": [asdict(t) for t in timings],
                                                "settings": {k: str(v) for k, v in vars(args).items() if k != "func"},
                                                "threads": torch.get_num_threads(), "machine": info}, indent=2) + "\n")
    return 0
