"""The serving metrics on hand-made timestamps (times in s, latencies in ms)."""

from __future__ import annotations

import numpy as np
import pytest

from pagedserve.bench.metrics import RequestRecord, compute_metrics, error_counts, latency_stats

# sent at 1.0 s; chunks at 1.2 (1 token), 1.5 (2 tokens), 2.0 (1 token): 4 tokens in 3 chunks
A = RequestRecord(prompt_len=10, expected_output_len=4, send_time_s=1.0, chunk_times_s=(1.2, 1.5, 2.0),
                  output_tokens=4)
# sent at 0.0 s; one chunk with one token at 0.4 s
B = RequestRecord(prompt_len=6, expected_output_len=1, send_time_s=0.0, chunk_times_s=(0.4,), output_tokens=1)
FAILED = RequestRecord(prompt_len=100, expected_output_len=8, send_time_s=0.5, chunk_times_s=(0.6, 0.7),
                       output_tokens=2, error="RESOURCE_EXHAUSTED")
EMPTY = RequestRecord(prompt_len=3, expected_output_len=8, send_time_s=0.5, chunk_times_s=(), output_tokens=0)


def test_per_request_definitions():
    assert A.ttft_s == pytest.approx(0.2)
    assert A.e2el_s == pytest.approx(1.0)
    assert A.itls_s == pytest.approx([0.3, 0.5])  # one entry per chunk gap, not per token
    assert A.tpot_s == pytest.approx((1.0 - 0.2) / (4 - 1))
    assert B.tpot_s is None and B.itls_s == [] and B.ttft_s == B.e2el_s == pytest.approx(0.4)


def test_latency_stats_are_numpy_linear_percentiles_in_ms():
    values_s = [0.001, 0.002, 0.003, 0.004, 0.010]
    stats = latency_stats(values_s)
    assert stats.count == 5
    assert stats.mean_ms == pytest.approx(4.0)
    assert stats.median_ms == pytest.approx(3.0)
    assert stats.p90_ms == pytest.approx(7.6)  # 4 + 0.6 * (10 - 4)
    assert stats.p99_ms == pytest.approx(9.76)  # 4 + 0.96 * (10 - 4)
    assert stats.std_ms == pytest.approx(float(np.std([1, 2, 3, 4, 10])))
    assert latency_stats([]) == latency_stats([]).__class__(0, 0.0, 0.0, 0.0, 0.0, 0.0)


def test_run_metrics_exclude_failed_requests():
    m = compute_metrics([A, B, FAILED, EMPTY], duration_s=2.0)
    assert (m.completed, m.failed) == (2, 2)
    assert m.total_input_tokens == 16 and m.total_output_tokens == 5
    assert m.request_throughput == pytest.approx(1.0)
    assert m.output_throughput == pytest.approx(2.5)
    assert m.total_token_throughput == pytest.approx(10.5)
    assert m.ttft.count == 2 and m.ttft.mean_ms == pytest.approx(300.0) and m.ttft.median_ms == pytest.approx(300.0)
    assert m.e2el.mean_ms == pytest.approx(700.0) and m.e2el.p99_ms == pytest.approx(400 + 0.99 * 600)
    # TPOT only from A (B has one token)
    assert m.tpot.count == 1 and m.tpot.mean_ms == pytest.approx(800.0 / 3)
    # ITL: A's two gaps only (FAILED's gap is excluded)
    assert m.itl.count == 2 and m.itl.mean_ms == pytest.approx(400.0) and m.itl.p90_ms == pytest.approx(480.0)
    assert error_counts([A, B, FAILED, EMPTY]) == {"RESOURCE_EXHAUSTED": 1, "NO_TOKENS": 1}


def test_all_failed_reports_zero_latencies_and_rejects_bad_duration():
    m = compute_metrics([FAILED], duration_s=1.0)
    assert m.completed == 0 and m.failed == 1 and m.ttft.count == 0 and m.ttft.mean_ms == 0.0
    with pytest.raises(ValueError):
        compute_metrics([A], duration_s=0.0)
