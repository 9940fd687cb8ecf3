"""The scheduler's series after scripted requests through the real Scheduler (ScriptedRunner as the worker)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from pagedserve.engine.config import SchedulerConfig
from pagedserve.engine.messages import FinishReason
from pagedserve.engine.scheduler import Scheduler
from pagedserve.services.common.metrics import render
from pagedserve.services.scheduler.metrics import SchedulerMetrics
from tests.scheduler.scripted_runner import ScriptedRunner
from tests.scheduler.test_scheduler import request


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def samples(metrics: SchedulerMetrics) -> dict[tuple[str, tuple], float]:
    """Every sample of the rendered registry, parsed back: (name, sorted labels) -> value."""
    body, content_type = render(metrics.registry)
    assert content_type.startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(body.decode()) for s in family.samples}


def value(parsed: dict, name: str, **labels: str) -> float:
    return parsed[(name, tuple(sorted({"model_name": "m", **labels}.items())))]


def run(scheduler: Scheduler, metrics: SchedulerMetrics, runner: ScriptedRunner, clock: Clock,
        stats: list) -> None:
    """Steps until every request is done, one clock second per step (as the loop would)."""
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule(["w"])
        metrics.outputs(out.outputs)
        for worker_id, plan in out.plans.items():
            metrics.plan_sent(worker_id, plan, 0)
            metrics.observe_plan_size(worker_id, 1000)
            clock.now += 1.0
            outputs = scheduler.update_from_output({worker_id: runner.execute(plan)})
            metrics.outputs(outputs)
            for o in outputs:
                if o.finished and not scheduler.has_request(o.request_id):
                    metrics.request_closed(o.request_id)
        stats[0] = scheduler.stats()


def test_scripted_requests_move_every_scheduler_series_exactly():
    clock = Clock()
    scheduler = Scheduler(SchedulerConfig(block_size=4, max_num_seqs=8, max_num_batched_tokens=64))
    scheduler.add_worker("w", num_blocks=32)
    stats = [scheduler.stats()]
    metrics = SchedulerMetrics(lambda: (stats[0], "m"), clock=clock)
    runner = ScriptedRunner(32, 4)
    for rid in ("a", "b"):
        scheduler.add_request(request(rid, prompt_len=8, max_tokens=3))
        metrics.request_added(rid)
    clock.now += 2.0  # both wait two seconds before the first schedule

    # mid-flight: one step in, both running and holding blocks
    out = scheduler.schedule(["w"])
    metrics.plan_sent("w", out.plans["w"], 0)
    clock.now += 1.0
    metrics.outputs(scheduler.update_from_output({"w": runner.execute(out.plans["w"])}))
    stats[0] = scheduler.stats()
    busy = samples(metrics)
    assert value(busy, "vllm:num_requests_running") == 2
    assert value(busy, "vllm:num_requests_waiting") == 0
    # 8 prompt tokens each in 4-token blocks (the first output token gets its slot at the next schedule)
    assert value(busy, "vllm:kv_cache_usage_perc") == 4 / 32
    assert value(busy, "pagedserve_worker_kv_cache_usage_perc", worker="w") == 4 / 32

    run(scheduler, metrics, runner, clock, stats)
    done = samples(metrics)
    assert value(done, "vllm:num_requests_running") == 0
    assert value(done, "vllm:kv_cache_usage_perc") == 0.0
    assert value(done, "vllm:request_queue_time_seconds_count") == 2
    assert value(done, "vllm:request_queue_time_seconds_sum") == 4.0  # 2 s each
    assert value(done, "vllm:request_prefill_time_seconds_sum") == 2.0  # first token one step (1 s) after scheduling
    assert value(done, "vllm:request_decode_time_seconds_sum") == 4.0  # 3 tokens: 2 more steps each
    assert value(done, "vllm:request_decode_time_seconds_bucket", le="2.0") == 2
    assert value(done, "vllm:request_decode_time_seconds_bucket", le="1.5") == 0
    assert value(done, "pagedserve_plan_bytes_count", worker="w") == 2  # two more steps after the first one
    assert value(done, "vllm:prefix_cache_queries_total") == stats[0].prefix_cache_queries > 0
    assert value(done, "vllm:num_preemptions_total") == 0


def test_counters_stay_monotonic_when_a_worker_leaves():
    from pagedserve.engine.config import SchedulerStats

    snapshot = [SchedulerStats(0, 0, 3, 0, (), prefix_cache_queries=100, prefix_cache_hits=40)]
    metrics = SchedulerMetrics(lambda: (snapshot[0], "m"))
    assert value(samples(metrics), "vllm:prefix_cache_hits_total") == 40
    snapshot[0] = SchedulerStats(0, 0, 3, 0, (), prefix_cache_queries=10, prefix_cache_hits=4)  # worker gone
    assert value(samples(metrics), "vllm:prefix_cache_hits_total") == 40
    snapshot[0] = SchedulerStats(0, 0, 5, 0, (), prefix_cache_queries=30, prefix_cache_hits=10)
    parsed = samples(metrics)
    assert value(parsed, "vllm:prefix_cache_hits_total") == 46
    assert value(parsed, "vllm:prefix_cache_queries_total") == 120
    assert value(parsed, "vllm:num_preemptions_total") == 5


def test_a_request_aborted_while_waiting_observes_nothing():
    clock = Clock()
    scheduler = Scheduler(SchedulerConfig(block_size=4))
    stats = [scheduler.stats()]
    metrics = SchedulerMetrics(lambda: (stats[0], "m"), clock=clock)
    scheduler.add_request(request("x", prompt_len=4, max_tokens=2))
    metrics.request_added("x")
    outputs = scheduler.abort_request("x")
    assert outputs and outputs[0].finish_reason is FinishReason.ABORT
    metrics.outputs(outputs)
    metrics.request_closed("x")
    assert ("vllm:request_queue_time_seconds_count", (("model_name", "m"),)) not in samples(metrics)


def test_spec_decode_series_follow_the_counters_only_when_the_scheduler_speculates():
    from pagedserve.engine.config import SchedulerStats
    from pagedserve.engine.spec_decode.counters import SpecDecodeCounters

    counters = SpecDecodeCounters(num_drafts=5, num_draft_tokens=17, num_accepted_tokens=9,
                                  num_accepted_tokens_per_pos=(5, 3, 1)) + SpecDecodeCounters.zero(4)
    stats = SchedulerStats(0, 0, 0, 0, (), spec_decode=counters)
    parsed = samples(SchedulerMetrics(lambda: (stats, "m")))
    assert value(parsed, "vllm:spec_decode_num_drafts_total") == 5
    assert value(parsed, "vllm:spec_decode_num_draft_tokens_total") == 17
    assert value(parsed, "vllm:spec_decode_num_accepted_tokens_total") == 9
    # every draft position 0..k-1 has its sample, the ones no draft reached yet at 0
    assert [value(parsed, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(p))
            for p in range(4)] == [5, 3, 1, 0]
    plain = samples(SchedulerMetrics(lambda: (SchedulerStats(0, 0, 0, 0, ()), "m")))
    assert not [name for name, _ in plain if name.startswith("vllm:spec_decode")]
