"""`bench serve`'s load generator against an in-process fake gateway (grpc.aio, no model)."""

from __future__ import annotations

import argparse
import asyncio
import math

import grpc
import numpy as np
import pytest

from pagedserve.bench.datasets import SampleRequest
from pagedserve.bench.serve import LoadSettings, arrival_offsets, parse_rates, run_load
from pagedserve.services.common.pb import generate_pb2 as gen
from pagedserve.services.common.pb import generate_pb2_grpc


class FakeGateway(generate_pb2_grpc.GenerationServicer):
    """Streams max_tokens tokens two per chunk (the last chunk may hold one), 10 ms apart; "fail" is refused."""

    def __init__(self) -> None:
        self.requests: list[gen.GenerateRequest] = []
        self.in_flight = 0
        self.most_in_flight = 0

    async def Generate(self, request, context):
        self.requests.append(request)
        if request.prompt == "fail":
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy")
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            left = request.sampling_params.max_tokens
            while left:
                await asyncio.sleep(0.01)
                n = min(2, left)
                left -= n
                yield gen.GenerateResponse(token_ids=[7] * n)
            yield gen.GenerateResponse(finish_reason=gen.FINISH_REASON_LENGTH)  # no tokens: not timed
        finally:
            self.in_flight -= 1


async def _against_fake(samples, load):
    fake = FakeGateway()
    server = grpc.aio.server()
    generate_pb2_grpc.add_GenerationServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        records, duration = await run_load(f"127.0.0.1:{port}", samples, load, temperature=0.0, ignore_eos=True,
                                           timeout_s=10)
    finally:
        await server.stop(None)
    return fake, records, duration


def test_records_tokens_chunks_and_errors():
    samples = [SampleRequest("hello", 3, 5), SampleRequest("fail", 2, 4), SampleRequest("hi", 1, 1)]
    fake, records, duration = asyncio.run(_against_fake(samples, LoadSettings(math.inf)))
    ok, failed, single = records
    assert ok.output_tokens == 5 and len(ok.chunk_times_s) == 3 and ok.error is None
    assert ok.prompt_len == 3 and ok.expected_output_len == 5
    assert 0 <= ok.send_time_s < ok.chunk_times_s[0] <= ok.chunk_times_s[-1] <= duration
    assert failed.error == "RESOURCE_EXHAUSTED" and not failed.success
    assert single.output_tokens == 1 and single.tpot_s is None
    sent = {r.prompt: r.sampling_params for r in fake.requests}
    assert sent["hello"].max_tokens == 5 and sent["hello"].ignore_eos and sent["hello"].temperature == 0.0
    assert fake.most_in_flight == 2  # rate inf: all at once


def test_max_concurrency_one_sends_in_turn():
    samples = [SampleRequest(f"p{i}", 1, 2) for i in range(3)]
    fake, records, _ = asyncio.run(_against_fake(samples, LoadSettings(math.inf, max_concurrency=1)))
    assert fake.most_in_flight == 1
    for before, after in zip(records, records[1:]):
        assert after.send_time_s >= before.chunk_times_s[-1]


def test_rate_spaces_the_sends():
    samples = [SampleRequest(f"p{i}", 1, 1) for i in range(4)]
    load = LoadSettings(20.0, seed=3)
    _, records, _ = asyncio.run(_against_fake(samples, load))
    for record, due in zip(records, arrival_offsets(4, load)):
        assert record.send_time_s == pytest.approx(due, abs=0.03)


def test_arrival_offsets_follow_gamma_gaps():
    assert arrival_offsets(3, LoadSettings(math.inf)) == [0.0, 0.0, 0.0]
    poisson = arrival_offsets(4001, LoadSettings(4.0, burstiness=1.0, seed=1))
    gaps = np.diff(poisson)
    assert poisson[0] == 0.0 and gaps.mean() == pytest.approx(0.25, rel=0.05)
    assert gaps.std() == pytest.approx(0.25, rel=0.08)  # exponential: std = mean
    steady = np.diff(arrival_offsets(4001, LoadSettings(4.0, burstiness=16.0, seed=1)))
    assert steady.mean() == pytest.approx(0.25, rel=0.05) and steady.std() == pytest.approx(0.25 / 4, rel=0.1)
    assert arrival_offsets(5, LoadSettings(2.0, seed=9)) == arrival_offsets(5, LoadSettings(2.0, seed=9))


def test_parse_rates():
    assert parse_rates("1,2.5,inf") == (1.0, 2.5, math.inf)
    for bad in ("0", "fast", "1,-2", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_rates(bad)


def test_openai_stream_reader_times_text_chunks_and_takes_usage_tokens():
    """The SSE reader of `bench serve --backend openai`: one time per chunk with text, the token
    count from the usage chunk, nothing read after [DONE]."""
    from pagedserve.bench.load_senders import _read_completion_stream

    lines = ['data: {"choices": [{"index": 0, "text": "Hel", "finish_reason": null}]}', "",
             'data: {"choices": [{"index": 0, "text": "", "finish_reason": null}]}', "",
             'data: {"choices": [{"index": 0, "text": "lo", "finish_reason": "length"}]}', "",
             'data: {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}}', "",
             "data: [DONE]", "", 'data: {"choices": [{"index": 0, "text": "late"}]}']

    async def feed():
        for line in lines:
            yield line

    times: list[float] = []
    tokens = asyncio.run(_read_completion_stream(feed(), times, 0.0))
    assert tokens == 4
    assert len(times) == 2


def test_openai_stream_reader_counts_text_chunks_without_a_usage_chunk():
    from pagedserve.bench.load_senders import _read_completion_stream

    lines = ['data: {"choices": [{"index": 0, "text": "a"}]}', 'data: {"choices": [{"index": 0, "text": "b"}]}',
             "data: [DONE]"]

    async def feed():
        for line in lines:
            yield line

    times: list[float] = []
    assert asyncio.run(_read_completion_stream(feed(), times, 0.0)) == 2
