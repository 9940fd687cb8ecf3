"""`pagedserve bench serve` against a real stack: redis-server, scheduler, one worker, gateway."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.model]

LATENCIES = ("ttft", "tpot", "itl", "e2el")


@pytest.fixture(scope="module")
def gateway(stack, default_model):
    return stack.gateway, default_model


def _check_run(run: dict, rate: float | str) -> None:
    settings, metrics, requests = run["settings"], run["metrics"], run["requests"]
    assert settings["request_rate"] == rate and settings["ignore_eos"] is True and settings["num_prompts"] == 4
    assert (metrics["completed"], metrics["failed"]) == (4, 0)
    assert metrics["total_output_tokens"] == 16  # 4 prompts x 4 tokens, EOS ignored
    assert metrics["total_input_tokens"] == sum(r["prompt_len"] for r in requests)
    assert metrics["duration_s"] > 0
    assert metrics["output_throughput"] == pytest.approx(16 / metrics["duration_s"])
    assert metrics["request_throughput"] == pytest.approx(4 / metrics["duration_s"])
    assert len(requests) == 4 and all(r["error"] is None and r["output_tokens"] == 4 for r in requests)
    for key in LATENCIES:
        stats = metrics[key]
        assert stats["count"] > 0
        assert 0 < stats["mean_ms"] <= stats["p99_ms"] and stats["median_ms"] <= stats["p90_ms"] <= stats["p99_ms"]
    assert metrics["ttft"]["mean_ms"] <= metrics["e2el"]["mean_ms"]
    assert metrics["tpot"]["count"] == 4 and metrics["itl"]["count"] >= 4


def test_bench_serve_reports_consistent_figures(gateway, tmp_path):
    target, model = gateway
    out, plots = tmp_path / "serve.json", tmp_path / "plots"
    result = subprocess.run(
        [sys.executable, "-m", "pagedserve", "bench", "serve", "--target", target, "--model", str(model),
         "--dataset-name", "random", "--num-prompts", "4", "--input-len", "16", "--output-len", "4",
         "--ignore-eos", "--request-rate", "100,inf", "--result-json", str(out), "--plot", str(plots)],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Serving Benchmark Result" in result.stdout and "Mean TTFT (ms)" in result.stdout
    report = json.loads(out.read_text())
    runs = report["runs"]
    assert report["machine"]["cores"] > 0
    assert len(runs) == 2
    _check_run(runs[0], 100.0)
    _check_run(runs[1], "inf")
    assert sorted(p.name for p in plots.iterdir()) == sorted(
        [f"{k}_cdf.png" for k in LATENCIES] + ["throughput_vs_rate.png"])


def test_bench_serve_compares_the_grpc_and_openai_apis(stack, default_model, tmp_path):
    """`--backend grpc,openai`: the same requests through both front ends, the OpenAI one streamed
    from /v1/completions; both give the same token counts, and a comparison table is printed."""
    out = tmp_path / "serve-apis.json"
    result = subprocess.run(
        [sys.executable, "-m", "pagedserve", "bench", "serve", "--backend", "grpc,openai", "--target", stack.gateway,
         "--base-url", stack.http, "--model", str(default_model), "--dataset-name", "random", "--num-prompts", "4",
         "--input-len", "16", "--output-len", "4", "--ignore-eos", "--request-rate", "inf",
         "--result-json", str(out), "--disable-tqdm"],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "tok/s vs first" in result.stdout
    runs = json.loads(out.read_text())["runs"]
    assert [r["settings"]["backend"] for r in runs] == ["grpc", "openai"]
    for run in runs:  # ITL and TPOT count text chunks for openai: a token that completes no character sends none
        metrics, requests = run["metrics"], run["requests"]
        assert (metrics["completed"], metrics["failed"]) == (4, 0)
        assert metrics["total_output_tokens"] == 16
        assert all(r["error"] is None and r["output_tokens"] == 4 for r in requests)
        assert 0 < metrics["ttft"]["mean_ms"] <= metrics["e2el"]["mean_ms"]
