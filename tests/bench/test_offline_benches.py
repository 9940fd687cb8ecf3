"""Smoke runs of `bench throughput` and `bench overhead` on tiny workloads: the report's fields are
present and consistent. (Benchmarks themselves do not run in CI.)"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import subprocess
import sys

import pytest

from pagedserve.cli import main

pytestmark = [pytest.mark.model]

TINY = ["--dataset-name", "random", "--num-prompts", "3", "--input-len", "8", "--output-len", "4",
        "--kv-cache-memory", "64MiB"]


def bench(*args: str) -> str:
    """Runs ``pagedserve bench ARGS`` through the CLI's entry point in this process and returns what it
    printed (a subprocess per smoke run imported torch again: ~3 CPU-s each; one test below runs the
    real command line); fails on a non-zero exit."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_:
        main(["bench", *args])
    assert exit_.value.code == 0, out.getvalue()[-3000:]
    return out.getvalue()


def test_throughput_report(tmp_path, small_model):
    out = tmp_path / "t.json"
    stdout = bench("throughput", "--model", str(small_model), *TINY, "--hf-batch-sizes", "2,3",
                   "--result-json", str(out))
    report = json.loads(out.read_text())
    assert {"engine_output_tokens_per_s", "hf_output_tokens_per_s", "ratio"} <= report.keys()
    assert [r["system"] for r in report["runs"]] == ["pagedserve", "hf-b2", "hf-b3"]
    assert all(r["output_tokens"] == 12 for r in report["runs"])  # 3 requests x 4 tokens, EOS ignored
    best = max(report["runs"][1:], key=lambda r: r["output_tokens_per_s"])
    assert report["hf_output_tokens_per_s"] == pytest.approx(best["output_tokens_per_s"])
    assert report["ratio"] == pytest.approx(report["engine_output_tokens_per_s"] / report["hf_output_tokens_per_s"])
    assert "ratio pagedserve / best transformers" in stdout


@pytest.mark.e2e
def test_overhead_report(tmp_path, small_model):
    out = tmp_path / "o.json"
    bench("overhead", "--model", str(small_model), *TINY, "--ttft-repeats", "2", "--iterations", "10",
          "--running", "4,8", "--max-plans-in-flight", "1,2", "--result-json", str(out))
    report = json.loads(out.read_text())
    assert set(report["by_max_plans_in_flight"]) == {"1", "2"}
    for side in report["by_max_plans_in_flight"].values():
        assert side["stack_to_engine_throughput_ratio"] == pytest.approx(
            side["stack_output_tokens_per_s"] / side["engine_output_tokens_per_s"])
        assert len(side["stack_ttft_ms"]) == len(side["engine_ttft_ms"]) == 2
        assert side["ttft_added_ms"] == pytest.approx(statistics.median(
            s - e for s, e in zip(side["stack_ttft_ms"], side["engine_ttft_ms"])))
    assert set(report["scheduler_ms_per_iteration"]) == {"4", "8"}
    assert all(c["median_ms"] <= c["p99_ms"] for c in report["scheduler_cost"])


def test_overhead_runs_the_in_process_engine_under_the_stacks_scheduling_policy(small_model):
    """Not the offline engine's defaults (full prefill chunks, prompts first come first served): that
    policy alone made the stack look 16% slower than the engine on 32 ShareGPT requests."""
    from pagedserve.bench.overhead import _InProcess
    from pagedserve.engine.config import SchedulerConfig

    flags = argparse.Namespace(kv_cache_memory="64MiB", threads_per_worker=1, gemm_backend="auto",
                               compile_mode="eager", kv_cache_dtype="auto")
    policy = SchedulerConfig(max_num_batched_tokens=256, max_plans_in_flight=1)
    side = _InProcess(small_model, flags, policy)
    assert side.llm.config.scheduler == policy
    assert (policy.max_decode_slowdown, policy.short_prompt_share) == (2.0, 0.5)


def test_feature_benchmark_reports(tmp_path, small_model):
    cases = {
        "prefix-cache": (["--prefix-len", "40", "--suffix-len", "4", "--requests", "2"], {"ttft_ratio"}),
        "parallel-sampling": (["--prompt-len", "40", "--output-len", "4"], {"kv_ratio"}),
        "chunked-prefill": (["--decoders", "2", "--decode-len", "6", "--long-prompts", "1", "--long-len", "40",
                             "--budget", "16"], {"p99_itl_ratio", "throughput_ratio"}),
    }
    for name, (flags, keys) in cases.items():
        out = tmp_path / f"{name}.json"
        bench(name, "--model", str(small_model), "--kv-cache-memory", "64MiB", *flags, "--result-json", str(out))
        report = json.loads(out.read_text())
        assert keys <= report.keys(), name
        assert all(report[k] > 0 for k in keys), name
    sampling = json.loads((tmp_path / "parallel-sampling.json").read_text())
    assert sampling["kv_ratio"] == pytest.approx(sampling["parallel_peak_blocks"] / sampling["independent_peak_blocks"])
    assert sampling["parallel_peak_blocks"] < sampling["independent_peak_blocks"]


def test_profile_report_accounts_for_the_step(tmp_path, small_model):
    from pagedserve.engine.models.panel_gemm import panels_available

    out = tmp_path / "p.json"
    stdout = bench("profile", "--model", str(small_model), "--batches", "1,4", "--prefill-len", "32",
                   "--context-len", "16", "--steps", "2", "--kv-cache-memory", "64MiB", "--result-json", str(out))
    cases = json.loads(out.read_text())["cases"]
    assert list(cases) == ["decode x1", "decode x4", "prefill 32"]
    for case in cases.values():
        pieces = sum(case[k] for k in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "attention"))
        assert 0 < pieces < case["forward"] <= case["step"]
        assert case["gemm_floor"]["torch.mm"] > 0 and case["gemm_floor"]["onednn"] > 0
        assert case["gemm_floor"].get("panels", 1.0) > 0
    assert "| step / torch.mm floor |" in stdout and "| step / onednn floor |" in stdout
    assert panels_available() == ("| step / panels floor |" in stdout)


def test_profile_refuses_batches_the_kv_cache_cannot_hold_at_once_instead_of_waiting_forever(small_model):
    result = subprocess.run([sys.executable, "-m", "pagedserve", "bench", "profile", "--model", str(small_model),
                             "--batches", "1,64", "--context-len", "200", "--kv-cache-memory", "4MiB"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 1
    assert "decode x64: 64 sequences of up to 215 tokens need 896 KV blocks" in result.stderr
    assert "give --kv-cache-memory" in result.stderr and "decode x1" not in result.stdout  # before any case ran


def test_profile_decodes_a_batch_that_fits_though_admission_headroom_would_hold_some_back(tmp_path, small_model):
    """16 sequences of 120 tokens fit in 160 blocks (8 KiB each on the small model) as they decode, but not
    with room for 0.7 of the ~300 tokens each may yet generate: under the engine's default admission
    headroom only some ran at once, and the case waited for all of them for ever (seen: 256 x 300 tokens,
    4 GiB, over 10 minutes without output)."""
    out = tmp_path / "p.json"
    bench("profile", "--model", str(small_model), "--batches", "16", "--context-len", "120", "--prefill-len", "32",
          "--steps", "2", "--kv-cache-memory", "1280KiB", "--result-json", str(out))
    assert json.loads(out.read_text())["cases"]["decode x16"]["step"] > 0


def test_profile_workload_accounts_for_a_dataset_run(tmp_path, small_model):
    out = tmp_path / "w.json"
    stdout = bench("profile-workload", "--model", str(small_model), "--dataset-name", "random", "--num-prompts", "3",
                   "--input-len", "20", "--output-len", "6", "--kv-cache-memory", "64MiB", "--result-json", str(out))
    report = json.loads(out.read_text())
    seconds = report["seconds"]
    assert report["output_tokens"] == 18 and report["dtype"] == "float32"
    assert 0 < seconds["attention"] < seconds["forward"] <= seconds["step"] <= report["elapsed_s"]
    assert "share of steps" in stdout and "gate_up_proj" in stdout


def test_token_budget_sweep_reports_each_budget(tmp_path, small_model):
    out = tmp_path / "b.json"
    stdout = bench("token-budget", "--model", str(small_model), "--dataset-name", "random", "--num-prompts", "4",
                   "--input-len", "40", "--output-len", "5", "--kv-cache-memory", "64MiB", "--budgets", "16,64",
                   "--request-rate", "inf", "--result-json", str(out))
    report = json.loads(out.read_text())
    assert [r["budget"] for r in report["runs"]] == [16, 64]
    for run in report["runs"]:
        assert run["output_tokens_per_s"] > 0 and 0 < run["itl_p50_ms"] <= run["itl_p99_ms"]
        assert run["ttft_mean_ms"] > 0
    assert "vs largest" in stdout


def test_long_prompt_itl_reports_each_configuration(tmp_path, small_model):
    out = tmp_path / "l.json"
    stdout = bench("long-prompt-itl", "--model", str(small_model), "--configs", "64:inf,64:2", "--streams", "2",
                   "--long-prompt", "200", "--alone-tokens", "6", "--kv-cache-memory", "64MiB", "--result-json", str(out))
    report = json.loads(out.read_text())
    assert [(r["budget"], r["max_decode_slowdown"]) for r in report["runs"]] == [(64, float("inf")), (64, 2.0)]
    for run in report["runs"]:
        assert 0 < run["alone_p50_ms"] <= run["alone_p99_ms"] and 0 < run["beside_p50_ms"] <= run["beside_p99_ms"]
        assert run["p99_ratio"] == pytest.approx(run["beside_p99_ms"] / run["alone_p99_ms"])
        assert run["long_ttft_ms"] > 0 and run["longest_gap_ms"] >= run["beside_p99_ms"]
    assert "p99 ratio" in stdout


def test_arrival_offsets_are_seeded_poisson_or_all_at_once():
    from pagedserve.bench.token_budget import arrival_offsets

    assert arrival_offsets(3, float("inf"), 0) == [0.0, 0.0, 0.0]
    offsets = arrival_offsets(2000, 4.0, 1)
    assert offsets == arrival_offsets(2000, 4.0, 1) and offsets[0] == 0.0
    assert offsets == sorted(offsets) and 450 < offsets[-1] < 550  # mean gap 1/4 s


def test_placement_report(tmp_path, small_model):
    out = tmp_path / "p.json"
    bench("placement", "--model", str(small_model), "--workers", "2", "--systems", "2", "--users", "4",
          "--system-len", "64", "--user-len", "4", "--output-len", "2", "--request-rate", "20",
          "--kv-cache-memory", "32MiB", "--result-json", str(out))
    report = json.loads(out.read_text())
    runs = report["runs"]
    assert set(runs) == {"least-loaded", "prefix"} and all(r["requests"] == 8 for r in runs.values())
    assert runs["prefix"]["hit_rate"] >= runs["least-loaded"]["hit_rate"]
    assert report["ttft_mean_ratio"] == pytest.approx(runs["prefix"]["ttft_mean_ms"] / runs["least-loaded"]["ttft_mean_ms"])


def test_throughput_takes_the_kv_cache_dtype(tmp_path, small_model):
    out = tmp_path / "t.json"
    bench("throughput", "--model", str(small_model), *TINY, "--skip-hf", "--kv-cache-dtype", "fp8_e5m2",
          "--result-json", str(out))
    report = json.loads(out.read_text())
    assert report["settings"]["kv_cache_dtype"] == "fp8_e5m2" and report["runs"][0]["output_tokens"] == 12


def test_attention_op_report(tmp_path):
    """Each KV dtype's GB/s is its bytes over its time, its share of the streaming read in the same run."""
    from pagedserve.engine.attention.cpu_op import load_cpu_attention_op

    if load_cpu_attention_op() is None:
        pytest.skip("the C++ op could not be built here")
    out = tmp_path / "a.json"
    stdout = bench("attention-op", "--num-seqs", "4", "--context-len", "40", "--layers", "2", "--rounds", "2",
                   "--result-json", str(out))
    report = json.loads(out.read_text())
    assert [(o["kv_cache_dtype"], o["cache_dtype"]) for o in report["ops"]] == [
        ("auto", "float32"), ("bfloat16", "bfloat16"), ("fp8_e5m2", "float8_e5m2")]
    float32_bytes = report["ops"][0]["kv_bytes"]
    assert [o["kv_bytes"] for o in report["ops"]] == [float32_bytes, float32_bytes // 2, float32_bytes // 4]
    for o in report["ops"]:
        assert o["gbps"] == pytest.approx(o["kv_bytes"] / o["ms"] / 1e6)
        assert o["stream_share"] == pytest.approx(o["gbps"] / report["stream_gbps"])  # the read on 2 MiB pages
    assert report["stream_gbps_4k_pages"] > 0 and "% of stream" in stdout
    assert "streaming read, 2 MiB pages" in stdout and "streaming read, 4 KiB pages" in stdout


def test_attention_op_report_for_a_bfloat16_model(tmp_path):
    """--dtype bfloat16: a bfloat16 query, and the cache in bfloat16 under auto."""
    from pagedserve.engine.attention.cpu_op import load_cpu_attention_op

    if load_cpu_attention_op() is None:
        pytest.skip("the C++ op could not be built here")
    out = tmp_path / "a.json"
    stdout = bench("attention-op", "--dtype", "bfloat16", "--num-seqs", "4", "--context-len", "40", "--layers", "2",
                   "--rounds", "2", "--result-json", str(out))
    report = json.loads(out.read_text())
    assert [(o["kv_cache_dtype"], o["cache_dtype"]) for o in report["ops"]] == [
        ("auto", "bfloat16"), ("bfloat16", "bfloat16"), ("fp8_e5m2", "float8_e5m2")]
    assert report["ops"][0]["kv_bytes"] == report["ops"][1]["kv_bytes"] == 2 * report["ops"][2]["kv_bytes"]
    assert "bfloat16 query" in stdout


def test_prefill_attention_report(tmp_path):
    """Each length's GFLOP/s is its causal products over each kernel's time; the ratio is the times'."""
    from pagedserve.engine.attention.prefill_op import prefill_op_available

    if not prefill_op_available():
        pytest.skip("the prefill attention op needs AVX2, FMA and a compiler")
    out = tmp_path / "p.json"
    stdout = bench("prefill-attention", "--prompt-lens", "16,40", "--context-len", "8", "--rounds", "1",
                   "--result-json", str(out))
    timings = json.loads(out.read_text())["timings"]
    assert [(t["prompt_len"], t["context_len"]) for t in timings] == [(16, 8), (40, 8)]
    for t in timings:
        gflop = 4 * 64 * 9 * (t["prompt_len"] * 8 + t["prompt_len"] * (t["prompt_len"] + 1) // 2) / 1e9
        assert t["op_gflops"] == pytest.approx(gflop / t["op_ms"] * 1e3)
        assert t["torch_gflops"] == pytest.approx(gflop / t["torch_ms"] * 1e3)
        assert t["speedup"] == pytest.approx(t["torch_ms"] / t["op_ms"])
    assert "torch SDPA ms" in stdout and "8 cached positions" in stdout


@pytest.mark.parametrize("flags,message", [
    (["--prompt-lens", "12,x"], "must be comma-separated positive integers, got '12,x'"),
    (["--prompt-lens", "0"], "must be positive, got 0"),
    (["--context-len", "-1"], "must be 0 or more, got -1"),
    (["--head-dim", "24"], "must be a multiple of 16"),
])
def test_prefill_attention_refuses_bad_flags_with_a_usage_error(capsys, flags, message):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "prefill-attention", *flags])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gemm_rows_report(tmp_path, dtype):
    """Each kernel's GB/s is the weights' bytes over its time, at each row count asked for."""
    from pagedserve.engine.models.onednn import few_rows_available
    from pagedserve.engine.models.panel_gemm import panels_available

    if not (few_rows_available() if dtype == "bfloat16" else panels_available()):
        pytest.skip(f"no {dtype} kernel here (AVX512_BF16 / AVX2 and FMA, and a C++ compiler)")
    out = tmp_path / "g.json"
    stdout = bench("gemm-rows", "--dtype", dtype, "--rows", "1,3", "--layers", "1", "--rounds", "2",
                   "--result-json", str(out))
    report = json.loads(out.read_text())
    elements = 960 * 576 + 576 * 576 + 3072 * 576 + 576 * 1536 + 49152 * 576
    weight_bytes = elements * (2 if dtype == "bfloat16" else 4)
    assert [t["rows"] for t in report["timings"]] == [1, 3]
    for t in report["timings"]:
        for kernel in ("onednn", "kernel"):
            assert t[f"{kernel}_gbps"] == pytest.approx(weight_bytes / t[f"{kernel}_ms"] / 1e6)
            assert t[f"{kernel}_gflops"] == pytest.approx(2 * t["rows"] * elements / t[f"{kernel}_ms"] / 1e6)
    name = "few-row" if dtype == "bfloat16" else "panels"
    assert report["kernel"] == name and report["stream_gbps"] > 0
    assert f"{name} GB/s" in stdout and "streaming read" in stdout
