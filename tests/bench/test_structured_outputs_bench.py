"""Smoke run of `bench structured-outputs` on a tiny workload: the report's fields are present and
consistent. (Benchmarks themselves do not run in CI.)"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.model]


def test_structured_outputs_report(tmp_path, small_model):
    out = tmp_path / "so.json"
    result = subprocess.run(
        [sys.executable, "-m", "pagedserve", "bench", "structured-outputs", "--model", str(small_model),
         "--dataset-name", "random", "--num-prompts", "3", "--input-len", "8", "--output-len", "5",
         "--kv-cache-memory", "64MiB", "--streams", "2", "--arrivals", "2", "--before-tokens", "2",
         "--arrival-tokens", "2", "--result-json", str(out)],
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    free, constrained = report["free"], report["constrained"]
    assert free["output_tokens"] == constrained["output_tokens"] == 15  # 3 requests x 5 tokens, EOS ignored
    assert report["ratio"] == pytest.approx(constrained["output_tokens_per_s"] / free["output_tokens_per_s"])
    assert 0 < report["mask_share_of_constrained_pass"] < 1
    assert [m["batch"] for m in report["mask"]] == [1, 3]
    for m in report["mask"]:
        assert m["steps"] >= 1
        assert m["us_per_row"] == pytest.approx(1000 * m["ms_per_step_mean"] / m["batch"])
    assert len(report["gateway_check_ms"]) == 2
    stalls = {s["arrivals"]: s for s in report["compile_stall"]}
    assert list(stalls) == ["free", "cold", "warm"]
    assert stalls["free"]["worker_compile_ms"] == 0  # no structure, no matcher
    assert stalls["cold"]["longest_compile_ms"] > stalls["warm"]["longest_compile_ms"]  # the cache serves them
    for s in stalls.values():
        assert s["during_p50_ms"] <= s["during_p99_ms"] <= s["longest_gap_ms"]
        assert s["before_p50_ms"] <= s["before_p99_ms"]
        assert s["longest_compile_ms"] <= s["worker_compile_ms"]
    assert "ratio json schema / free" in result.stdout
