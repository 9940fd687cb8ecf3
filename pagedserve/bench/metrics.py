"""Serving metrics from per-request timestamps, defined as vLLM's serving benchmark defines them.

All functions are pure: they take ``RequestRecord`` values (times in seconds since the benchmark
started) and return figures; latencies are reported in milliseconds.

Definitions (per successful request):
    TTFT  = time of the first chunk that carried tokens - send time.
    E2EL  = time of the last chunk that carried tokens - send time.
    ITL   = every gap between consecutive token-carrying chunks (one entry per gap, whatever
            the number of tokens in the chunk).
    TPOT  = (E2EL - TTFT) / (output tokens - 1), only for requests with more than one output token.
Failed requests (a gRPC error, or no tokens at all) count in ``failed`` and nowhere else.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

PERCENTILES = (90, 99)


@dataclass(frozen=True)
class RequestRecord:
    """What the client saw of one request.

    Attributes:
        prompt_len: prompt length in tokens (from the dataset's tokenizer).
        expected_output_len: ``max_tokens`` asked for.
        send_time_s: when the call was started, s since the benchmark start.
        chunk_times_s: when each response that carried token ids arrived, s since the benchmark start.
        output_tokens: token ids received in all.
        error: the gRPC status name (``"RESOURCE_EXHAUSTED"``) when the call failed, else ``None``.
    """

    prompt_len: int
    expected_output_len: int
    send_time_s: float
    chunk_times_s: tuple[float, ...]
    output_tokens: int
    error: str | None = None

    @property
    def success(self) -> bool:
        """The call ended without an error and produced at least one token."""
        return self.error is None and bool(self.chunk_times_s)

    @property
    def ttft_s(self) -> float:
        return self.chunk_times_s[0] - self.send_time_s

    @property
    def e2el_s(self) -> float:
        return self.chunk_times_s[-1] - self.send_time_s

    @property
    def itls_s(self) -> list[float]:
        times = self.chunk_times_s
        return [b - a for a, b in zip(times, times[1:])]

    @property
    def tpot_s(self) -> float | None:
        """``(E2EL - TTFT) / (output tokens - 1)``; ``None`` for a single output token."""
        if self.output_tokens < 2:
            return None
        return (self.e2el_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass(frozen=True)
class LatencyStats:
    """Summary of one latency, in ms. ``count``: samples; with none, every figure is 0 (as vLLM reports)."""

    count: int
    mean_ms: float
    median_ms: float
    std_ms: float
    p90_ms: float
    p99_ms: float


@dataclass(frozen=True)
class ServeMetrics:
    """Every figure of one benchmark run.

    Attributes:
        completed, failed: request counts.
        duration_s: wall time from the first send to the last response, s.
        total_input_tokens: prompt tokens of the completed requests.
        total_output_tokens: tokens received by the completed requests.
        request_throughput: completed requests per second (req/s).
        output_throughput: output tokens per second (tok/s).
        total_token_throughput: (input + output) tokens per second (tok/s).
        ttft, tpot, itl, e2el: latency summaries (ms).
    """

    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    ttft: LatencyStats
    tpot: LatencyStats
    itl: LatencyStats
    e2el: LatencyStats


def latency_stats(values_s: Iterable[float]) -> LatencyStats:
    """Mean, median, standard deviation and p90/p99 (``numpy.percentile``, linear) of seconds, in ms."""
    import numpy as np

    ms = np.asarray(list(values_s), dtype=float) * 1000.0
    if ms.size == 0:
        return LatencyStats(0, 0.0, 0.0, 0.0, 0.0, 0.0)
    p90, p99 = (float(np.percentile(ms, p)) for p in PERCENTILES)
    return LatencyStats(int(ms.size), float(ms.mean()), float(np.median(ms)), float(ms.std()), p90, p99)


def compute_metrics(records: Sequence[RequestRecord], duration_s: float) -> ServeMetrics:
    """The run's figures from its records and its wall duration (s).

    Raises:
        ValueError: a non-positive duration.
    """
    if duration_s <= 0:
        raise ValueError(f"duration_s must be positive, got {duration_s}")
    done = [r for r in records if r.success]
    input_tokens = sum(r.prompt_len for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    tpots = [t for t in (r.tpot_s for r in done) if t is not None]
    return ServeMetrics(
        completed=len(done),
        failed=len(records) - len(done),
        duration_s=duration_s,
        total_input_tokens=input_tokens,
        total_output_tokens=output_tokens,
        request_throughput=len(done) / duration_s,
        output_throughput=output_tokens / duration_s,
        total_token_throughput=(input_tokens + output_tokens) / duration_s,
        ttft=latency_stats(r.ttft_s for r in done),
        tpot=latency_stats(tpots),
        itl=latency_stats(itl for r in done for itl in r.itls_s),
        e2el=latency_stats(r.e2el_s for r in done),
    )


def error_counts(records: Iterable[RequestRecord]) -> dict[str, int]:
    """Failed requests by reason (gRPC status name, or ``"NO_TOKENS"``)."""
    counts: dict[str, int] = {}
    for r in records:
        if not r.success:
            reason = r.error or "NO_TOKENS"
            counts[reason] = counts.get(reason, 0) + 1
    return counts
