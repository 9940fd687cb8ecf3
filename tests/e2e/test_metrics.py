"""End to end: every service's /metrics over HTTP, after real gRPC requests through the real stack.

Uses the session's stack (other tests may have run on it before), so every counter and histogram
is checked as the difference between a scrape before and one after this test's requests.
"""

from __future__ import annotations

import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.processes import wait_until
from tests.e2e.test_stack import QUESTIONS, assert_all_blocks_free, chat_request, stream

pytestmark = [pytest.mark.e2e, pytest.mark.model]

NUM_REQUESTS = 5
MAX_TOKENS = 6


def scrape(address: str) -> dict[tuple[str, tuple], float]:
    """One service's /metrics, parsed: (sample name, sorted labels) -> value."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def total(parsed: dict, name: str, **labels: str) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels``."""
    return sum(v for (n, ls), v in parsed.items() if n == name and set(labels.items()) <= set(ls))


def test_metrics_of_every_service_move_by_what_the_clients_received(stack, default_model):
    model = default_model.name
    assert_all_blocks_free(stack)
    before = {name: scrape(address) for name, address in stack.metrics.items()}
    requests = [chat_request(q, max_tokens=MAX_TOKENS, ignore_eos=True) for q in QUESTIONS[:NUM_REQUESTS]]
    with ThreadPoolExecutor(NUM_REQUESTS) as pool:
        results = list(pool.map(lambda r: stream(stack.gateway, r), requests))
    received = sum(len(r.token_ids) for responses in results for r in responses)
    assert received == NUM_REQUESTS * MAX_TOKENS
    prompt_tokens = sum(responses[-1].usage.prompt_tokens for responses in results)
    gaps = sum(len([r for r in responses if r.token_ids]) - 1 for responses in results)

    def settled() -> bool:  # the scheduler's gauges come from a snapshot, the stream length from a poll
        s = scrape(stack.metrics["scheduler"])
        return (total(s, "vllm:num_requests_running") == 0 and total(s, "vllm:kv_cache_usage_perc") == 0
                and total(s, "pagedserve_redis_stream_length") == 0)

    wait_until(settled, "scheduler metrics back to idle", 30)
    after = {name: scrape(address) for name, address in stack.metrics.items()}

    def moved(service: str, name: str, **labels: str) -> float:
        return total(after[service], name, model_name=model, **labels) - total(before[service], name, model_name=model,
                                                                                **labels)

    # gateway: what its clients saw
    assert moved("gateway", "vllm:request_success_total", finished_reason="length") == NUM_REQUESTS
    assert moved("gateway", "vllm:request_success_total") == NUM_REQUESTS
    assert moved("gateway", "vllm:generation_tokens_total") == received
    assert moved("gateway", "vllm:prompt_tokens_total") == prompt_tokens
    assert moved("gateway", "vllm:time_to_first_token_seconds_count") == NUM_REQUESTS
    assert moved("gateway", "vllm:e2e_request_latency_seconds_count") == NUM_REQUESTS
    assert moved("gateway", "vllm:inter_token_latency_seconds_count") == gaps
    assert total(after["gateway"], "pagedserve_gateway_requests_in_flight", model_name=model) == 0
    # scheduler: one observation of each phase per request, and the gauges back to idle
    for phase in ("queue", "prefill", "decode"):
        assert moved("scheduler", f"vllm:request_{phase}_time_seconds_count") == NUM_REQUESTS, phase
    assert moved("scheduler", "pagedserve_plan_bytes_count") >= MAX_TOKENS
    assert moved("scheduler", "pagedserve_plans_sent_ahead_total") >= MAX_TOKENS // 2  # overlap scheduling is on
    assert moved("scheduler", "vllm:prefix_cache_queries_total") >= prompt_tokens - NUM_REQUESTS
    assert total(after["scheduler"], "vllm:num_requests_waiting", model_name=model) == 0
    assert ("vllm:num_requests_running", (("model_name", model),)) in after["scheduler"]
    # workers: their steps, by worker
    workers = [name for name in stack.metrics if name.startswith("worker-")]
    steps = sum(moved(w, "pagedserve_worker_step_seconds_count", worker=w) for w in workers)
    assert steps >= MAX_TOKENS
    # nothing is counted by two processes
    for name in ("gateway", *workers):
        assert total(after[name], "vllm:request_queue_time_seconds_count") == 0
    for name in ("scheduler", *workers):
        assert total(after[name], "vllm:generation_tokens_total") == 0


def test_the_gateway_http_port_serves_its_metrics_and_counts_http_requests(stack, default_model):
    """``GET /metrics`` on the OpenAI port is the gateway's registry, and HTTP requests count in it."""
    import httpx

    model = default_model.name
    http_address = stack.http.removeprefix("http://")
    before = scrape(http_address)
    body = {"model": model, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0,
            "ignore_eos": True}
    reply = httpx.post(f"{stack.http}/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 4
    after = scrape(http_address)
    by_port = scrape(stack.metrics["gateway"])

    def moved(name: str, **labels: str) -> float:
        return total(after, name, model_name=model, **labels) - total(before, name, model_name=model, **labels)

    assert moved("vllm:request_success_total", finished_reason="length") == 1
    assert moved("vllm:generation_tokens_total") == 4
    assert moved("vllm:time_to_first_token_seconds_count") == 1
    assert total(by_port, "vllm:generation_tokens_total") == total(after, "vllm:generation_tokens_total")


def test_the_gateway_http_port_offers_the_cluster_s_queue_and_kv_series(stack, default_model):
    """vLLM's running/waiting/KV series on the one URL vLLM has (issue #24), read from the schedulers;
    the gateway's own metrics port leaves them to the schedulers, so scraping every port counts them once."""
    import grpc

    from pagedserve.services.common.pb import generate_pb2_grpc

    model = default_model.name
    http_address = stack.http.removeprefix("http://")
    assert_all_blocks_free(stack)
    request = chat_request(QUESTIONS[0], max_tokens=400, ignore_eos=True)
    with grpc.insecure_channel(stack.gateway) as channel:
        responses = generate_pb2_grpc.GenerationStub(channel).Generate(request, timeout=300)
        next(r for r in responses if r.token_ids)  # running now, its blocks held
        gateway, scheduler = scrape(http_address), scrape(stack.metrics["scheduler"])
        responses.cancel()
    own = scrape(stack.metrics["gateway"])
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert total(gateway, name, model_name=model) == pytest.approx(total(scheduler, name, model_name=model),
                                                                        abs=0.02), name
        assert not any(n == name for n, _ in own), name
    assert total(gateway, "vllm:num_requests_running", model_name=model) == 1
    assert total(gateway, "vllm:kv_cache_usage_perc", model_name=model) > 0
    wait_until(lambda: total(scrape(http_address), "vllm:kv_cache_usage_perc") == 0, "the cluster's KV usage back to 0", 30)
