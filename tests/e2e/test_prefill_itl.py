"""A long prompt must not freeze the streams decoding on its worker (issue #20, defect 4).

Through the session stack (scheduler with its default token budget, two one-thread workers): four
greedy streams decode, spread over both workers; then a prompt of several hundred tokens arrives.
Its prefill chunks are sized so that a step with decodes in it stays within a small multiple of
the decodes' own step time (``pagedserve.engine.step_cost``), so the streams' longest gap while
it is prefilled stays near their gap before it. With chunks that fill the token budget, the
whole prompt ran in one step and every stream on that worker waited for all of it.
"""

from __future__ import annotations

import random
import statistics
import time

import grpc
import pytest

from pagedserve.services.common.pb import generate_pb2_grpc
from tests.e2e.processes import wait_until
from tests.e2e.timed_streams import TimedStreams, token_request

pytestmark = [pytest.mark.e2e, pytest.mark.model]

NUM_STREAMS = 4  # two per worker: placement balances them by load
LONG_PROMPT_TOKENS = 600  # with the streams, fits the 64 MiB KV cache of a stack worker (91 blocks of 16)
MIN_WINDOW_S = 6.0  # the streams are watched this long after the long prompt arrives, or 12 of their gaps


def test_a_long_prompt_keeps_the_streams_on_its_worker_decoding(stack):
    rng = random.Random(20)
    with grpc.insecure_channel(stack.gateway) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        requests = [token_request([rng.randrange(1000, 20000) for _ in range(16)], 400) for _ in range(NUM_STREAMS)]
        with TimedStreams(stub, requests, timeout_s=120) as streams:
            wait_until(lambda: all(len(a) >= 6 for a in streams.arrivals), "every stream decoding", 60)
            before = streams.gaps_before(skip=1)  # gaps while they decode alone
            sent = time.monotonic()
            long_call = stub.Generate(token_request([rng.randrange(1000, 20000) for _ in range(LONG_PROMPT_TOKENS)], 1),
                                      timeout=120)
            time.sleep(max(MIN_WINDOW_S, 12 * statistics.median(before)))
            ended = time.monotonic()
        long_call.cancel()
    gaps_during = streams.gaps_during(sent, ended)
    alone = statistics.median(before)
    longest = max(gaps_during)
    print(f"\nstreams' median gap alone {alone * 1000:.0f} ms; longest gap with a {LONG_PROMPT_TOKENS}-token prompt "
          f"arriving {longest * 1000:.0f} ms ({longest / alone:.1f}x)")
    # The whole prompt in one step took ~30x a decode step here (longer than the window); sized chunks ~2x.
    assert longest < 4 * alone + 1.0
