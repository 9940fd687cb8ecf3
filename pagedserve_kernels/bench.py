"""GPU benchmark and correctness check of the paged-KV Triton kernels.

Times the KV-cache write, paged decode and paged prefill kernels on CUDA. First
checks every kernel against pagedserve_kernels.reference (in the --check-dtypes, default
float16 and bfloat16) and prints PASS/FAIL; then times each case with
triton.testing.do_bench (median) and prints milliseconds, achieved GB/s (the
minimum bytes the operation must move), that bandwidth as a percentage of a
device-to-device torch copy measured in the same run, TFLOP/s for attention,
and the speedup over a batched torch baseline (block gather +
scaled_dot_product_attention, see pagedserve_kernels.bench_baselines) timed in the same
run. Exit status: 0 ok, 1 a check or a case failed, 2 no CUDA device.

Usage: ``python -m pagedserve_kernels.bench [--main-only] [--json results.json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass, field

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
CHECK_TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}


@dataclass
class Case:
    """One benchmark shape. ``kind`` is decode, prefill or write."""
    kind: str
    num_seqs: int
    seq_len: int            # context per sequence incl. new tokens (write: unused)
    query_len: int = 1      # new tokens per sequence (write: tokens written)
    num_kv_heads: int = 8
    num_heads: int = 32
    head_dim: int = 128
    block_size: int = 16
    num_splits: int | None = None
    tag: str = ""

    def shape(self) -> str:
        heads = f"H{self.num_heads}/{self.num_kv_heads} D{self.head_dim} bs{self.block_size}"
        if self.kind == "write":
            return f"T={self.num_seqs * self.query_len} {heads}"
        split = "" if self.num_splits is None else f" splits={self.num_splits}"
        return f"S={self.num_seqs} L={self.seq_len} q={self.query_len} {heads}{split}"


@dataclass
class Result:
    kernel: str
    shape: str
    dtype: str
    ms: float = float("nan")
    gbps: float = float("nan")
    copy_ratio: float = float("nan")
    tflops: float = float("nan")
    torch_ms: float = float("nan")
    speedup: float = float("nan")
    error: str = ""
    extra: dict = field(default_factory=dict)


CASES = [
    Case("decode", 64, 2048, tag="main"),
    Case("decode", 64, 2048, block_size=32),
    Case("decode", 256, 1024),
    Case("decode", 8, 8192),
    Case("decode", 1, 32768),                    # flash-decoding: auto splits
    Case("decode", 1, 32768, num_splits=1),      # same without splitting
    Case("decode", 32, 4096, num_kv_heads=32, num_heads=32, head_dim=64),
    Case("prefill", 4, 2048, query_len=2048),
    Case("prefill", 8, 2048, query_len=512),     # extend: 1536 cached tokens
    Case("write", 64, 0, query_len=1),           # one decode step
    Case("write", 16, 0, query_len=1024),        # a prefill chunk
]


def _make_inputs(case: Case, dtype: torch.dtype, gen: torch.Generator, dev: str = "cuda") -> dict:
    """Random shuffled paged cache, block tables and queries on ``dev``."""
    nb = -(-max(case.seq_len, 1) // case.block_size)
    tokens = case.num_seqs * case.query_len
    num_blocks = case.num_seqs * nb + 2 * (-(-tokens // case.block_size))
    shape = (num_blocks, case.block_size, case.num_kv_heads, case.head_dim)
    k_cache = torch.randn(shape, device=dev, dtype=dtype, generator=gen)
    v_cache = torch.randn(shape, device=dev, dtype=dtype, generator=gen)
    perm = torch.randperm(num_blocks, device=dev, generator=gen)
    return dict(
        k_cache=k_cache, v_cache=v_cache,
        block_tables=perm[:case.num_seqs * nb].view(case.num_seqs, nb).to(torch.int32),
        seq_lens=torch.full((case.num_seqs,), case.seq_len, device=dev, dtype=torch.int32),
        query_start_loc=torch.arange(0, tokens + 1, case.query_len, device=dev, dtype=torch.int32),
        query=torch.randn(tokens, case.num_heads, case.head_dim, device=dev, dtype=dtype,
                          generator=gen),
        kv_new=torch.randn(tokens, case.num_kv_heads, case.head_dim, device=dev, dtype=dtype,
                           generator=gen),
        slots=torch.randperm(num_blocks * case.block_size, device=dev, generator=gen)[:tokens],
    )


def _callables(case: Case, x: dict):
    """Return (triton_fn, torch_fn, bytes_moved, flops) for a case."""
    from pagedserve_kernels import bench_baselines as base
    from pagedserve_kernels import paged_decode_attention, paged_prefill_attention, write_kv_cache

    elem = x["k_cache"].element_size()
    q, k_cache, v_cache, table, lens = (x["query"], x["k_cache"], x["v_cache"],
                                        x["block_tables"], x["seq_lens"])
    scale = case.head_dim ** -0.5
    out = torch.empty_like(q)
    if case.kind == "write":
        new, slots = x["kv_new"], x["slots"]
        return (lambda: write_kv_cache(new, new, k_cache, v_cache, slots),
                lambda: base.write_kv_cache_torch(new, new, k_cache, v_cache, slots),
                4 * new.numel() * elem, 0.0)

    def decode():
        return paged_decode_attention(q, k_cache, v_cache, table, lens, scale,
                                      num_splits=case.num_splits, out=out,
                                      max_seq_len=case.seq_len)

    def prefill():
        return paged_prefill_attention(q, k_cache, v_cache, table, lens, x["query_start_loc"],
                                       scale, case.query_len, out=out)

    def torch_fn():
        return base.attention_torch(q, k_cache, v_cache, table, case.seq_len, case.query_len,
                                    scale)

    q_bytes = 2 * q.numel() * elem                                   # read q + write out
    kv_bytes = 2 * case.num_seqs * case.seq_len * case.num_kv_heads * case.head_dim * elem
    ctx = case.seq_len - case.query_len
    pairs = case.num_seqs * (case.query_len * ctx + case.query_len * (case.query_len + 1) // 2)
    flops = 4.0 * pairs * case.num_heads * case.head_dim
    fn = decode if case.kind == "decode" else prefill
    return fn, torch_fn, q_bytes + kv_bytes, flops


def run_case(case: Case, dtype: torch.dtype, copy_gbps: float, args) -> Result:
    """Time one case (triton kernel and torch baseline); errors are recorded, not raised."""
    from triton.testing import do_bench

    res = Result(f"{case.kind}{' [' + case.tag + ']' if case.tag else ''}", case.shape(),
                 str(dtype).replace("torch.", ""))
    try:
        x = _make_inputs(case, dtype, torch.Generator(device="cuda").manual_seed(0))
        fn, torch_fn, nbytes, flops = _callables(case, x)
        res.ms = do_bench(fn, warmup=args.warmup, rep=args.rep, return_mode="median")
        res.gbps = nbytes / res.ms / 1e6
        res.copy_ratio = res.gbps / copy_gbps
        res.tflops = flops / res.ms / 1e9 if flops else float("nan")
        if not args.no_torch:
            res.torch_ms = do_bench(torch_fn, warmup=args.warmup, rep=args.rep,
                                    return_mode="median")
            res.speedup = res.torch_ms / res.ms
    except Exception as exc:  # keep benchmarking the other cases
        res.error = f"{type(exc).__name__}: {exc}"[:300]
    finally:
        torch.cuda.empty_cache()
    return res


def copy_bandwidth_gbps(args) -> float:
    """Device-to-device copy bandwidth (read + write bytes) of a 1 GiB tensor."""
    from triton.testing import do_bench

    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=args.warmup, rep=args.rep, return_mode="median")
    del src, dst
    torch.cuda.empty_cache()
    return 2 * (1 << 30) / ms / 1e6


def run_checks(dtypes) -> list[dict]:
    """Correctness of every kernel against pagedserve_kernels.reference on ragged GPU batches."""
    from pagedserve_kernels.bench_checks import check_all
    return check_all(dtypes, CHECK_TOL)


def _finite(obj):
    """Replace NaN/inf floats by None so the JSON output is standard."""
    if isinstance(obj, float):
        return obj if obj == obj and abs(obj) != float("inf") else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return obj


def _fmt(v: float, spec: str) -> str:
    return "-" if v != v else format(v, spec)


def print_table(results: list[Result], copy_gbps: float) -> None:
    print(f"\ndevice-to-device copy bandwidth: {copy_gbps:,.0f} GB/s")
    head = (f"{'kernel':<17} {'shape':<44} {'dtype':<9} {'ms':>8} {'GB/s':>7} {'copy%':>6} "
            f"{'TFLOP/s':>8} {'torch ms':>9} {'speedup':>8}")
    print(head + "\n" + "-" * len(head))
    for r in results:
        if r.error:
            print(f"{r.kernel:<17} {r.shape:<44} {r.dtype:<9} ERROR {r.error}")
            continue
        print(f"{r.kernel:<17} {r.shape:<44} {r.dtype:<9} {r.ms:>8.4f} {_fmt(r.gbps, ',.0f'):>7} "
              f"{_fmt(100 * r.copy_ratio, '.0f'):>6} {_fmt(r.tflops, '.1f'):>8} "
              f"{_fmt(r.torch_ms, '.4f'):>9} {_fmt(r.speedup, '.2f'):>8}")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m pagedserve_kernels.bench",
        description=__doc__.split("\n\n")[1].replace("\n", " "),
        epilog="Main case: decode, 64 sequences x 2048 context, bfloat16, 32 query / 8 KV heads, "
               "head_dim 128, block_size 16.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--kinds", nargs="+", choices=["decode", "prefill", "write"],
                   default=["decode", "prefill", "write"], help="which kernels to time")
    p.add_argument("--main-only", action="store_true",
                   help="time only the main case (decode, 64 seqs x 2048 ctx, H32/8, D128, bs16)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16",
                   help="dtype of the timed cases")
    p.add_argument("--check-dtypes", nargs="*", choices=sorted(DTYPES),
                   default=["float16", "bfloat16"],
                   help="dtypes of the correctness checks (none: skip the checks)")
    p.add_argument("--no-torch", action="store_true", help="skip timing the torch baselines")
    p.add_argument("--warmup", type=int, default=25, help="do_bench warmup time per case (ms)")
    p.add_argument("--rep", type=int, default=100, help="do_bench measuring time per case (ms)")
    p.add_argument("--json", metavar="FILE", help="also write checks and results to FILE as JSON")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("pagedserve_kernels.bench needs a CUDA GPU, and torch.cuda.is_available() is False "
              "(CPU-only torch build or no visible device). Nothing was run.", file=sys.stderr)
        return 2
    if os.environ.get("TRITON_INTERPRET", "0") not in ("0", ""):
        print("unset TRITON_INTERPRET: the benchmark must run compiled kernels", file=sys.stderr)
        return 2
    import triton
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} "
          f"| triton {triton.__version__}")
    checks = run_checks([DTYPES[d] for d in args.check_dtypes]) if args.check_dtypes else []
    copy_gbps = copy_bandwidth_gbps(args)
    cases = [c for c in CASES if c.kind in args.kinds and (c.tag == "main" or not args.main_only)]
    results = []
    for case in cases:
        results.append(run_case(case, DTYPES[args.dtype], copy_gbps, args))
        print(f"  timed {results[-1].kernel} {results[-1].shape}", flush=True)
    print_table(results, copy_gbps)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(_finite({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                               "triton": triton.__version__, "copy_gbps": copy_gbps,
                               "checks": checks, "results": [asdict(r) for r in results]}),
                      f, indent=2, default=str)
        print(f"wrote {args.json}")
    failed = [c for c in checks if not c["passed"]] + [r for r in results if r.error]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
