"""Correctness checks run by ``pagedserve_kernels.bench`` before timing.

Each kernel is compared with :mod:`pagedserve_kernels.reference` (computed in float32 from
the same inputs) on ragged batches with shuffled block tables, GQA, context
lengths that are not block multiples, and an explicit Flash-Decoding split.
The batched torch baseline used for the speedup column is checked too. The
metric is ``max|out - ref| / max|ref|``.
"""

from __future__ import annotations

import torch

from pagedserve_kernels.reference import paged_attention_ref, write_kv_cache_ref


def _paged(seq_lens, block_size, num_kv_heads, head_dim, dtype, device, gen):
    """Random cache with each sequence in a random set of blocks; returns (k, v, block_tables)."""
    per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(per_seq) + 4
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    v = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros(len(seq_lens), max(per_seq), dtype=torch.int32)
    start = 0
    for i, nb in enumerate(per_seq):
        table[i, :nb] = perm[start:start + nb].to(torch.int32)
        start += nb
    return k, v, table.to(device)


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def _attention_case(kind, dtype, device, gen, ctx_q, group, head_dim, block_size, splits=None):
    """Run one decode/prefill/baseline check; return (shape string, relative error)."""
    from pagedserve_kernels import paged_decode_attention, paged_prefill_attention
    from pagedserve_kernels.bench_baselines import attention_torch

    seq_lens = [c + q for c, q in ctx_q]
    q_lens = [q for _, q in ctx_q]
    num_kv_heads = 2
    k, v, table = _paged(seq_lens, block_size, num_kv_heads, head_dim, dtype, device, gen)
    query = torch.randn(sum(q_lens), num_kv_heads * group, head_dim,
                        generator=gen).to(device=device, dtype=dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    qsl = torch.tensor([0] + q_lens, device=device).cumsum(0).to(torch.int32)
    scale = head_dim ** -0.5
    out = torch.full_like(query, float("nan"))
    if kind == "decode":
        paged_decode_attention(query, k, v, table, lens, scale, num_splits=splits, out=out)
    elif kind == "prefill":
        paged_prefill_attention(query, k, v, table, lens, qsl, scale, max(q_lens), out=out)
    else:  # batched torch baseline (uniform lengths)
        out = attention_torch(query, k, v, table, seq_lens[0], q_lens[0], scale)
    ref = paged_attention_ref(query.float(), k.float(), v.float(), table, lens, qsl, scale)
    shape = (f"{kind} ctx/q={ctx_q} G={group} D={head_dim} bs={block_size}"
             + (f" splits={splits}" if splits else ""))
    return shape, _rel(out, ref)


def _write_case(dtype, device, gen):
    from pagedserve_kernels import write_kv_cache

    k_cache = torch.randn(10, 16, 4, 128, generator=gen).to(device=device, dtype=dtype)
    v_cache = torch.randn(10, 16, 4, 128, generator=gen).to(device=device, dtype=dtype)
    key = torch.randn(37, 4, 128, generator=gen).to(device=device, dtype=dtype)
    value = torch.randn(37, 4, 128, generator=gen).to(device=device, dtype=dtype)
    slots = torch.randperm(160, generator=gen)[:37].to(device)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    write_kv_cache_ref(key, value, k_ref, v_ref, slots)
    write_kv_cache(key, value, k_cache, v_cache, slots)
    exact = torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    return "write T=37 Hkv=4 D=128 bs=16", 0.0 if exact else float("inf")


def check_all(dtypes, tolerances: dict, device: str = "cuda", long: bool = True) -> list[dict]:
    """Run every check for each dtype, print PASS/FAIL lines, return them as dicts.

    ``long=False`` shrinks the context lengths (for the CPU interpreter).
    """
    n = 1 if long else 0
    ragged = [(0, 1), (99, 1), (999 * n + 7, 1), (2500 * n + 40, 1)]
    extend = [(0, 150 * n + 19), (30, 1), (300 * n + 13, 77 * n + 9)]
    specs = [
        ("decode", ragged, 4, 128, 16, None),
        ("decode", ragged, 8, 128, 16, 5),
        ("decode", ragged, 1, 64, 32, None),
        ("decode", ragged, 3, 64, 8, 3),
        ("prefill", extend, 4, 128, 16, None),
        ("prefill", extend, 1, 64, 8, None),
        ("baseline", [(500 * n + 20, 1)] * 3, 4, 128, 16, None),
        ("baseline", [(300 * n + 20, 40)] * 2, 4, 128, 16, None),
    ]
    results = []
    for dtype in dtypes:
        gen = torch.Generator().manual_seed(0)
        runs = [lambda: _write_case(dtype, device, gen)]
        runs += [lambda s=s: _attention_case(s[0], dtype, device, gen, *s[1:]) for s in specs]
        for run in runs:
            try:
                shape, err = run()
                # the torch baseline runs SDPA in the low-precision dtype itself
                tol = tolerances[dtype] * (4 if shape.startswith("baseline") else 1)
                passed, note = err < tol, ""
            except Exception as exc:  # report and keep checking
                shape, err, tol = "(see error)", float("nan"), tolerances[dtype]
                passed, note = False, repr(exc)[:200]
            name = str(dtype).replace("torch.", "")
            print(f"[{'PASS' if passed else 'FAIL'}] {name:<8} {shape}  rel_err={err:.2e} "
                  f"(tol {tol:.0e}) {note}", flush=True)
            results.append(dict(dtype=name, check=shape, rel_err=err, passed=passed, note=note))
    return results
