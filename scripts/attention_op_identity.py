"""Issue #23: are the CPU attention op's outputs at a git revision and in the working tree the same bits?

    python scripts/attention_op_identity.py --base HEAD

Both ops (the base built as in ``attention_op_ab.py``) run ragged batches of 7 sequences (contexts of
1-70 tokens, 1, 5 or 20 new tokens, shuffled blocks of 16) for head shapes covering multi-head, GQA
groups of 2-8 and groups split 4 + 1 and 4 + 3, head dims 32-128, each with float32 and bfloat16 queries
and K/V stored as the query, bfloat16 or float8_e5m2; no ALiBi. Outputs are compared bit for bit.
Prints each case whose outputs differ and the count; exit status 2 when any does (1: an op could not be
built). A check for changes that should not change the arithmetic, not a test: a change may
legitimately reorder sums (then say so, with this count).
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention_op_ab import both_ops  # noqa: E402

from pagedserve.engine.attention import build_attention_metadata, compute_positions  # noqa: E402

SHAPES = ((9, 3, 64), (8, 8, 32), (12, 4, 48), (16, 2, 80), (32, 4, 96), (8, 1, 128), (14, 2, 112), (6, 6, 64),
          (16, 4, 64), (10, 2, 64), (8, 4, 64))
"""(query heads, KV heads, head dim)."""


def _batch(seed: int, heads: int, kv_heads: int, head_dim: int, q_dtype: torch.dtype, kv_dtype: torch.dtype):
    rng = random.Random(seed)
    contexts = [rng.randint(1, 70) for _ in range(7)]
    new = [rng.choice((1, 1, 5, 20)) for _ in range(7)]
    blocks = [-(-(c + n) // 16) for c, n in zip(contexts, new)]
    free = list(range(sum(blocks)))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(b)] for b in blocks]
    md = build_attention_metadata(new, contexts, tables, compute_positions(new, contexts), 16)
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(sum(new), heads, head_dim, generator=g).to(q_dtype)
    shape = (sum(blocks), 16, kv_heads, head_dim)
    return md, query, torch.randn(shape, generator=g).to(kv_dtype), torch.randn(shape, generator=g).to(kv_dtype)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, help="the git revision to compare the working tree's op with")
    args = p.parse_args()
    old, new = both_ops(args.base)
    cases = differing = 0
    for seed, (heads, kv_heads, head_dim) in enumerate(SHAPES):
        for q_dtype in (torch.float32, torch.bfloat16):
            for kv_dtype in dict.fromkeys((q_dtype, torch.bfloat16, torch.float8_e5m2)):
                md, query, k, v = _batch(seed, heads, kv_heads, head_dim, q_dtype, kv_dtype)
                outs = []
                for op in (old, new):
                    out = torch.empty_like(query)
                    op(out, query, k, v, md.block_tables, md.seq_lens, md.query_start_loc, head_dim ** -0.5)
                    outs.append(out)
                cases += 1
                bits = torch.int32 if q_dtype == torch.float32 else torch.int16
                if not torch.equal(outs[0].view(bits), outs[1].view(bits)):
                    differing += 1
                    print(f"differ: {heads}/{kv_heads} heads of {head_dim}, {q_dtype} query, {kv_dtype} K/V: "
                          f"largest difference {(outs[0].float() - outs[1].float()).abs().max().item():.3g}")
    print(f"{differing} of {cases} cases differ between {args.base} and the working tree")
    return 2 if differing else 0


if __name__ == "__main__":
    raise SystemExit(main())
