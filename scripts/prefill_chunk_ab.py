"""Issue #23: the CPU prefill attention op at a git revision against the working tree's, on chunks over a
cached context (a chunked prefill, a prefix hit, a short prompt's share beside a long one), alternated in
one process (this machine's speed drifts up to 1.5x within minutes, so only a same-process A/B resolves a
10% change).

    PYTHONPATH=. python scripts/prefill_chunk_ab.py --base 1bed016 [--shapes 16x400,32x400,64x400,16x800]

Each shape ``QxC`` is Q new tokens after C cached positions, read in place from one layer's float32 cache
through shuffled blocks of 16 (``prefill_attention_paged``, what the CPU backend calls for chunks of at
most 128 tokens), the default model's heads (9 query and 3 KV heads of 64, or ``--num-heads`` /
``--num-kv-heads`` / ``--head-dim``). The base revision's sources are built under another library name
(``pagedserve.bench.kernel_ab``) so both load side by side. Printed per shape: whether the two outputs
are bit-identical, each one's median microseconds per call and per new token (interleaved rounds), and
the ratio. A measurement, not a test.
"""

from __future__ import annotations

import argparse

import torch

from pagedserve.bench.attention_op import interleaved_median_ms
from pagedserve.bench.kernel_ab import files_at, renamed_library
from pagedserve.engine.attention.prefill_op import SOURCE, prefill_attention_paged, prefill_op_available


def _shape(text: str) -> tuple[int, int]:
    try:
        new, cached = (int(n) for n in text.split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a shape is NEWxCACHED, e.g. 16x400, got {text!r}") from None
    if new < 1 or cached < 0:
        raise argparse.ArgumentTypeError(f"NEW must be positive and CACHED not negative, got {text!r}")
    return new, cached


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True, help="the git revision to compare the working tree's op with")
    p.add_argument("--shapes", type=lambda t: [_shape(s) for s in t.split(",")],
                   default="1x415,4x400,16x400,32x400,64x400,16x800,32x800,64x800,128x1500",
                   help="NEWxCACHED, comma-separated (default %(default)s)")
    p.add_argument("--num-heads", type=int, default=9)
    p.add_argument("--num-kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds, median reported (default %(default)s)")
    args = p.parse_args()
    if not prefill_op_available():
        raise SystemExit("the working tree's prefill op could not be built (see the warning above)")
    old = renamed_library(files_at(args.base, SOURCE.parent), SOURCE, "pagedserve_prefill", "base",
                          f"the prefill op at {args.base}").prefill_attention_paged
    torch.manual_seed(0)
    block_size, H, Hkv, D = 16, args.num_heads, args.num_kv_heads, args.head_dim
    longest = max(new + cached for new, cached in args.shapes)
    num_blocks = -(-longest // block_size)
    key_cache, value_cache = (torch.randn(num_blocks, block_size, Hkv, D) for _ in range(2))
    block_ids = torch.randperm(num_blocks)
    print(f"{'new x cached':>14} {'same bits':>9} {'base us':>9} {'tree us':>9} {'base us/tok':>11} "
          f"{'tree us/tok':>11} {'tree/base':>9}")
    for new, cached in args.shapes:
        query = torch.randn(new, H, D)

        def base(_call: int = 0) -> torch.Tensor:
            out = torch.empty_like(query)
            old(out, query, key_cache, value_cache, block_ids, cached, D ** -0.5)
            return out

        def tree(_call: int = 0) -> torch.Tensor:
            return prefill_attention_paged(query, key_cache, value_cache, block_ids, cached, D ** -0.5)

        same = torch.equal(base(), tree())
        repeats = max(20, 40_000 // (new * (cached + new) // 64 + 1))
        base_ms, tree_ms = interleaved_median_ms([(base, repeats), (tree, repeats)], args.rounds)
        print(f"{f'{new} x {cached}':>14} {str(same):>9} {base_ms * 1e3:9.1f} {tree_ms * 1e3:9.1f} "
              f"{base_ms * 1e3 / new:11.2f} {tree_ms * 1e3 / new:11.2f} {tree_ms / base_ms:9.2f}", flush=True)


if __name__ == "__main__":
    main()
