"""The gateway's and worker's series, and the flags that serve them, with exact values."""

from __future__ import annotations

import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from pagedserve.cli import build_parser
from pagedserve.engine.messages import FinishReason
from pagedserve.stack_config import StackConfig
from pagedserve.engine.config import SchedulerConfig, SchedulerStats, WorkerStats
from pagedserve.engine.spec_decode.counters import SpecDecodeCounters
from pagedserve.engine.runner_config import RunnerConfig
from pagedserve.text.output_processor import TextDelta
from pagedserve.services.common.metrics import serve_metrics
from pagedserve.services.gateway.metrics import GatewayMetrics
from pagedserve.services.worker.metrics import WorkerMetrics


class Clock:
    def __init__(self) -> None:
        self.now = 10.0

    def __call__(self) -> float:
        return self.now


def parse(body: bytes) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(body.decode()) for s in family.samples}


def value(parsed: dict, name: str, **labels: str) -> float:
    return parsed[(name, tuple(sorted({"model_name": "m", **labels}.items())))]


def delta(num_tokens: int, finish: FinishReason | None = None) -> TextDelta:
    return TextDelta("x" * num_tokens, tuple(range(num_tokens)), finish, False, 0)


def test_two_scripted_requests_count_tokens_latencies_and_finish_reasons():
    clock = Clock()
    metrics = GatewayMetrics("m", in_flight=lambda: 3, clock=clock)
    first = metrics.start_request()  # n = 2: samples 0 and 1, each a child request as in vLLM
    clock.now += 0.5
    first.delta(0, delta(1), num_prompt_tokens=7)  # TTFT 0.5
    clock.now += 0.1
    first.delta(1, delta(2), num_prompt_tokens=7)  # TTFT 0.6
    clock.now += 0.2
    first.delta(0, delta(1, FinishReason.LENGTH), num_prompt_tokens=7)  # ITL 0.3, e2e 0.8
    clock.now += 0.2
    first.delta(1, delta(0, FinishReason.STOP), num_prompt_tokens=7)  # no token: e2e 1.0 only
    second = metrics.start_request()
    clock.now += 1.5
    second.delta(0, delta(3, FinishReason.LENGTH), num_prompt_tokens=5)  # TTFT 1.5, e2e 1.5

    body, content_type = metrics.render()
    assert content_type.startswith("text/plain; version=")  # what prometheus_client's own server sends
    parsed = parse(body)
    assert value(parsed, "vllm:generation_tokens_total") == 7
    assert value(parsed, "vllm:prompt_tokens_total") == 7 + 7 + 5
    assert value(parsed, "vllm:request_success_total", finished_reason="length") == 2
    assert value(parsed, "vllm:request_success_total", finished_reason="stop") == 1
    assert value(parsed, "vllm:request_success_total", finished_reason="abort") == 0
    assert value(parsed, "vllm:time_to_first_token_seconds_count") == 3
    assert abs(value(parsed, "vllm:time_to_first_token_seconds_sum") - 2.6) < 1e-9
    assert value(parsed, "vllm:time_to_first_token_seconds_bucket", le="0.5") == 1
    assert value(parsed, "vllm:inter_token_latency_seconds_count") == 1
    assert abs(value(parsed, "vllm:inter_token_latency_seconds_sum") - 0.3) < 1e-9
    assert value(parsed, "vllm:e2e_request_latency_seconds_count") == 3
    assert value(parsed, "pagedserve_gateway_requests_in_flight") == 3


def test_worker_step_time_is_served_over_http_on_a_free_port():
    metrics = WorkerMetrics("m", "worker-7")
    metrics.step_done(0.004)
    metrics.step_done(0.02)
    server = serve_metrics(metrics.registry, "127.0.0.1", 0, "worker")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10) as reply:
            parsed = parse(reply.read())
    finally:
        server.stop()
    assert value(parsed, "pagedserve_worker_step_seconds_count", worker="worker-7") == 2
    assert value(parsed, "pagedserve_worker_step_seconds_bucket", worker="worker-7", le="0.005") == 1
    assert not any(name.startswith(("python_", "process_")) for name, _ in parsed)  # our registry, not the global one
    assert serve_metrics(metrics.registry, "127.0.0.1", None, "worker") is None


def test_every_service_takes_metrics_port_and_up_spreads_its_ports():
    parser = build_parser()
    for command in (["scheduler"], ["worker"], ["gateway"]):
        assert parser.parse_args(command).metrics_port is None  # off unless asked for
        assert parser.parse_args([*command, "--metrics-port", "0"]).metrics_port == 0
    assert parser.parse_args(["up"]).metrics_port == 9450
    config = StackConfig(model=Path("m"), workers=2, host="127.0.0.1", port=1, scheduler_port=2, redis_url="redis://x",
                         runner=RunnerConfig(kv_cache_memory="1GiB"), policy=SchedulerConfig(), threads_per_worker=1,
                         data_dir=Path("."), metrics_port=9000)
    assert config.metrics_ports() == {"gateway": 9000, "scheduler-0": 9001, "worker-0": 9002, "worker-1": 9003}


def test_a_call_that_ends_early_counts_its_unfinished_samples_as_aborted():
    """Review finding: clients that left counted nowhere; vLLM counts them with reason abort."""
    metrics = GatewayMetrics("m", clock=Clock())
    call = metrics.start_request()  # n = 3
    call.delta(0, delta(1, FinishReason.LENGTH), num_prompt_tokens=4)
    call.delta(1, delta(1), num_prompt_tokens=4)
    call.aborted(num_samples=3)  # samples 1 and 2 never finished
    parsed = parse(metrics.render()[0])
    assert value(parsed, "vllm:request_success_total", finished_reason="abort") == 2
    assert value(parsed, "vllm:request_success_total", finished_reason="length") == 1
    assert value(parsed, "vllm:e2e_request_latency_seconds_count") == 1


def test_the_cluster_view_sums_schedulers_and_counts_a_worker_listed_twice_once():
    """During a takeover two schedulers may list the same worker: its blocks count once."""
    from pagedserve.services.gateway.cluster_metrics import cluster_gauges

    shared = WorkerStats("w-0", num_blocks=100, num_free_blocks=40, num_running=3)
    stats = [SchedulerStats(1, 3, 0, 0, (shared,)),
             SchedulerStats(0, 2, 0, 0, (shared, WorkerStats("w-1", 100, 100, 0)))]
    values = {f.name: f.samples[0].value for f in cluster_gauges(stats, "m")}
    assert values == {"vllm:num_requests_running": 5, "vllm:num_requests_waiting": 1,
                      "vllm:kv_cache_usage_perc": 0.3}
    assert {f.samples[0].labels["model_name"] for f in cluster_gauges([], "m")} == {"m"}


def test_the_cluster_counters_sum_schedulers_and_count_one_missing_from_a_scrape_once():
    """A scheduler that misses a scrape (GetStats timed out) adds only what it counted since when it
    answers again; a restarted one (a new id) adds from zero; spec-decode series appear once a
    speculating scheduler answers, with every draft position."""
    from pagedserve.services.gateway.cluster_metrics import ClusterView

    def stats(hits: int, spec: SpecDecodeCounters | None = None) -> SchedulerStats:
        return SchedulerStats(0, 0, 0, 0, (), prefix_cache_queries=2 * hits, prefix_cache_hits=hits, spec_decode=spec)

    def counters(sources):
        return {(s.name, s.labels.get("position")): s.value for f in view.families(sources)
                if f.type == "counter" for s in f.samples}

    view = ClusterView("m")
    first = counters([("a", stats(100)), ("b", stats(50))])
    assert first[("vllm:prefix_cache_hits_total", None)] == 150
    assert not [name for name, _ in first if name.startswith("vllm:spec_decode")]
    assert counters([("a", stats(110))])[("vllm:prefix_cache_hits_total", None)] == 160  # b missed it
    spec = SpecDecodeCounters(5, 17, 9, (5, 3, 1)) + SpecDecodeCounters.zero(4)
    again = counters([("a", stats(110)), ("b", stats(52)), ("c", stats(7, spec))])  # c: b's successor
    assert again[("vllm:prefix_cache_hits_total", None)] == 110 + 52 + 7
    assert again[("vllm:spec_decode_num_accepted_tokens_total", None)] == 9
    assert [again[("vllm:spec_decode_num_accepted_tokens_per_pos_total", str(p))] for p in range(4)] == [5, 3, 1, 0]
