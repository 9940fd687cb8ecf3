"""Cold grammar compiles must not stall the streams decoding beside them (issue #22).

Through a stack of its own (a scheduler, two workers): eight greedy free streams decode while ten
requests arrive at once, first without a structure (the baseline: their prefill), then each with its
own slow-to-compile JSON schema (500 optional properties, a 300-branch anyOf, 60 levels of nesting:
``pagedserve.bench.grammar_schemas.slow_schemas``; 25-45 ms each to build). The scheduler holds each
until the workers have built its grammar on their compile thread (``Worker.PrepareGrammar``), so no
step stops for a build; the bound is twice the free arrivals' longest gap plus 0.3 s. On this
2-core machine both workers build every grammar beside the decoding streams, so the structured
arrivals still cost more than free ones (at load 3.2-3.5: 767-783 ms against 414-451 ms free); the stall this
guards against is a step that builds them: ``bench structured-outputs`` measures that one alone.

The stack's workers hold the streams whole (``KV_CACHE``): on the session stack's 91 blocks a worker,
streams of 2,000 tokens filled the cache under CI load, preempted each other, and the arrivals queued
behind them (first come, first served) past the client's 120 s.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from pagedserve.bench.grammar_schemas import slow_schemas
from pagedserve.services.common.pb import generate_pb2_grpc
from tests.e2e.processes import start_stack, wait_until
from tests.e2e.timed_streams import TimedStreams, token_request

pytestmark = [pytest.mark.e2e, pytest.mark.model]

NUM_STREAMS = 8
NUM_ARRIVALS = 10
ARRIVAL_TOKENS = 4
STREAM_TOKENS = 1000  # each stream's max_tokens: 64 blocks with its prompt, decoding through every phase
KV_CACHE = "256MiB"  # 364 blocks a worker: five whole streams and the arrivals, with the admission headroom


@pytest.fixture(scope="module")
def roomy_stack(tmp_path_factory, default_model):
    stack = start_stack(tmp_path_factory.mktemp("grammar-itl"), default_model, kv_cache_memory=KV_CACHE)
    yield stack
    stack.stop()


def longest_gap_while(stub, arrivals: list, rng: random.Random) -> tuple[float, float]:
    """The free streams' median gap before ``arrivals`` are sent at once, and their longest gap until
    every arrival is served, seconds."""
    free = [token_request([rng.randrange(1000, 20000) for _ in range(16)], STREAM_TOKENS)
            for _ in range(NUM_STREAMS)]
    with TimedStreams(stub, free) as streams:
        wait_until(lambda: all(len(a) >= 8 for a in streams.arrivals), "every stream decoding", 60)
        before = streams.gaps_before(skip=2)  # gaps while they decode alone
        sent = time.monotonic()
        with ThreadPoolExecutor(len(arrivals)) as pool:
            served = list(pool.map(lambda r: list(stub.Generate(r, timeout=120)), arrivals))
        ended = time.monotonic()
    assert [sum(len(r.token_ids) for r in s) for s in served] == [ARRIVAL_TOKENS] * len(arrivals)
    return statistics.median(before), max(streams.gaps_during(sent, ended))


def cold_arrivals(prompts: list[list[int]], rng: random.Random) -> list:
    """One request per prompt, each with its own slow-to-compile schema that no worker has built yet."""
    requests = [token_request(p, ARRIVAL_TOKENS) for p in prompts]
    for request, schema in zip(requests, slow_schemas(len(prompts), seed=rng.randrange(1 << 30))):
        request.sampling_params.structured_output.json = json.dumps(schema)
    return requests


def test_ten_cold_grammars_stall_the_free_streams_no_more_than_ten_free_arrivals(roomy_stack):
    """The cold arrivals get a second try with new schemas when the first exceeds the bound: a longest
    gap is one sample, and on a loaded 2-core CI machine one run went over it (1,137 ms against a bound
    of 1,103); a step that built the grammars would stall both tries."""
    rng = random.Random(22)
    prompts = [[rng.randrange(1000, 20000) for _ in range(16)] for _ in range(NUM_ARRIVALS)]
    with grpc.insecure_channel(roomy_stack.gateway) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        alone, free_gap = longest_gap_while(stub, [token_request(p, ARRIVAL_TOKENS) for p in prompts], rng)
        bound = 2 * free_gap + 0.3
        cold_gaps = []
        for _ in range(2):
            cold_gaps.append(longest_gap_while(stub, cold_arrivals(prompts, rng), rng)[1])
            if cold_gaps[-1] < bound:
                break
    print(f"\nstreams' median gap alone {alone * 1000:.0f} ms; longest gap while {NUM_ARRIVALS} arrive: free "
          f"{free_gap * 1000:.0f} ms, with cold grammars {', '.join(f'{g * 1000:.0f}' for g in cold_gaps)} ms")
    assert min(cold_gaps) < bound
