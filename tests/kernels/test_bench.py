"""CPU-side checks of pagedserve_kernels.bench: its plumbing must work the first time on a GPU."""

import math

import pytest
import torch

from kernel_test_utils import DEVICE
from pagedserve_kernels import bench
from pagedserve_kernels.bench_checks import check_all

SMALL_CASES = [
    bench.Case("decode", 3, 40, num_kv_heads=2, num_heads=8, head_dim=64),
    bench.Case("decode", 2, 70, num_kv_heads=2, num_heads=2, head_dim=64, num_splits=3),
    bench.Case("prefill", 2, 50, query_len=20, num_kv_heads=2, num_heads=6, head_dim=64),
    bench.Case("write", 4, 0, query_len=5, num_kv_heads=2, num_heads=4, head_dim=64),
]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU exit path")
def test_bench_exits_cleanly_without_cuda(capsys):
    assert bench.main(["--main-only"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.parametrize("case", SMALL_CASES, ids=lambda c: c.kind)
def test_bench_callables_agree(case):
    """The timed triton callable and the torch baseline compute the same thing."""
    x = bench._make_inputs(case, torch.float32, torch.Generator(device=DEVICE).manual_seed(0),
                           dev=DEVICE)
    fn, torch_fn, nbytes, flops = bench._callables(case, x)
    assert nbytes > 0 and (flops > 0) == (case.kind != "write")
    if case.kind == "write":
        fn()
        rows = x["k_cache"].view(-1, case.num_kv_heads, case.head_dim)[x["slots"]]
        assert torch.equal(rows, x["kv_new"])
        torch_fn()
        return
    out, ref = fn().clone(), torch_fn()
    assert ((out - ref).abs().max() / ref.abs().max()).item() < 1e-5


def test_bench_table_and_json_helpers(capsys):
    ok = bench.Result("decode [main]", "S=1", "bfloat16", ms=0.1, gbps=2000.0, copy_ratio=0.5,
                      torch_ms=0.3, speedup=3.0)
    bad = bench.Result("prefill", "S=2", "bfloat16", error="RuntimeError: boom")
    bench.print_table([ok, bad], 4000.0)
    text = capsys.readouterr().out
    assert "3.00" in text and "ERROR RuntimeError: boom" in text
    assert bench._finite({"a": [math.nan, 1.0], "b": math.inf}) == {"a": [None, 1.0], "b": None}
    assert bench.parse_args(["--json", "x.json", "--check-dtypes"]).check_dtypes == []


def test_bench_correctness_checks_small():
    results = check_all([torch.float32], {torch.float32: 1e-5}, device=DEVICE, long=False)
    assert results and all(r["passed"] for r in results), results
