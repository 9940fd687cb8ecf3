"""Issue #23: the CPU decode attention op (``pagedserve/engine/attention/csrc``) at a git revision against the
working tree's, alternated in one process (this machine's speed drifts up to 1.5x within minutes, so only a
same-process A/B resolves a 10% change).

    python scripts/attention_op_ab.py --base fa39466 --num-seqs 256 --context-len 270 [--dtype bfloat16] [--kv-dtype bfloat16]

The base revision's sources are built into the op cache under another library name (``pagedserve_cpu_base``,
by ``pagedserve.bench.kernel_ab``), so both ops load side by side. A decode batch like `pagedserve bench
attention-op`'s (``--num-seqs`` sequences of ``--context-len`` +-25% tokens, 9 query and 3 KV heads of 64,
or ``--num-heads``/``--num-kv-heads``/``--head-dim``, shuffled blocks of 16, ``--layers`` caches called in
turn so K/V come from DRAM, allocated as a worker's are) runs through each, three alternated rounds of
``--rounds``; printed: the largest difference between their outputs, each one's median milliseconds per call
and K/V GB/s, and the ratio. A measurement, not a test.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from pagedserve.bench.attention_op import median_ms
from pagedserve.bench.kernel_ab import files_at, renamed_library
from pagedserve.engine.attention import build_attention_metadata, compute_positions
from pagedserve.engine.attention.cpu_op import SOURCE, load_cpu_attention_op
from pagedserve.engine.kv_cache import KVCache, KVCacheSpec, to_cache_dtype


def both_ops(revision: str):
    """(the op at ``revision``, the working tree's op). Raises SystemExit when the tree's cannot be built."""
    new = load_cpu_attention_op()
    if new is None:
        raise SystemExit("the working tree's op could not be built (see the warning above)")
    old = renamed_library(files_at(revision, SOURCE.parent), SOURCE, "pagedserve_cpu", "base", f"the op at {revision}")
    return old.paged_attention, new


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True, help="the git revision to compare the working tree's op with")
    p.add_argument("--num-seqs", type=int, default=64, help="decoding sequences (default %(default)s)")
    p.add_argument("--context-len", type=int, default=270, help="mean context tokens (default %(default)s)")
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"), help="the query's dtype")
    p.add_argument("--kv-dtype", default=None, choices=("float32", "bfloat16", "float8_e5m2"),
                   help="the caches' (default: --dtype)")
    p.add_argument("--num-heads", type=int, default=9, help="query heads (default %(default)s)")
    p.add_argument("--num-kv-heads", type=int, default=3, help="KV heads (default %(default)s)")
    p.add_argument("--head-dim", type=int, default=64, help="channels per head (default %(default)s)")
    p.add_argument("--layers", type=int, default=8, help="caches called in turn (default %(default)s)")
    p.add_argument("--rounds", type=int, default=7, help="timed rounds per turn (default %(default)s)")
    args = p.parse_args()
    old, new = both_ops(args.base)
    rng = random.Random(0)
    contexts = [rng.randint(args.context_len * 3 // 4, args.context_len * 5 // 4) for _ in range(args.num_seqs)]
    blocks = [-(-(c + 1) // 16) for c in contexts]
    free = list(range(sum(blocks)))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(n)] for n in blocks]
    ones = [1] * args.num_seqs
    md = build_attention_metadata(ones, contexts, tables, compute_positions(ones, contexts), 16)
    q_dtype, kv_dtype = getattr(torch, args.dtype), getattr(torch, args.kv_dtype or args.dtype)
    g = torch.Generator().manual_seed(0)
    query = torch.randn(args.num_seqs, args.num_heads, args.head_dim, generator=g).to(q_dtype)
    shape = (sum(blocks), 16, args.num_kv_heads, args.head_dim)
    kv_cache = KVCache(KVCacheSpec(args.layers, args.num_kv_heads, args.head_dim, 16, kv_dtype), sum(blocks))
    for layer in kv_cache.key_caches + kv_cache.value_caches:  # a worker's memory: 2 MiB pages where Linux gives them
        layer.copy_(to_cache_dtype(torch.randn(shape, generator=g), kv_dtype))
    caches = [kv_cache.layer(i) for i in range(args.layers)]
    outs = {}
    for name, op in (("base", old), ("tree", new)):
        out = torch.empty_like(query)
        op(out, query, *caches[0], md.block_tables, md.seq_lens, md.query_start_loc, args.head_dim ** -0.5)
        outs[name] = out.float()
    print(f"largest |tree - base| {(outs['tree'] - outs['base']).abs().max().item():.3g}")
    times: dict[str, list[float]] = {"base": [], "tree": []}
    for _ in range(3):
        for name, op in (("base", old), ("tree", new)):
            out = torch.empty_like(query)
            times[name].append(median_ms(lambda i: op(out, query, *caches[i % args.layers], md.block_tables,
                                                      md.seq_lens, md.query_start_loc, args.head_dim ** -0.5),
                                         4 * args.layers, args.rounds))
    kv_bytes = 2 * int(md.seq_lens.sum()) * args.num_kv_heads * args.head_dim * kv_dtype.itemsize
    base, tree = statistics.median(times["base"]), statistics.median(times["tree"])
    print(f"{args.num_seqs} x ~{args.context_len} tokens, {args.dtype} query, {str(kv_dtype).removeprefix('torch.')} K/V, "
          f"{torch.get_num_threads()} threads, {time.strftime('%H:%M UTC', time.gmtime())}")
    print(f"base {args.base}: {base:.3f} ms ({kv_bytes / base / 1e6:.2f} GB/s)   working tree: {tree:.3f} ms "
          f"({kv_bytes / tree / 1e6:.2f} GB/s)   speed-up {base / tree:.3f}x")


if __name__ == "__main__":
    main()
