"""The gateway's limits, through a second gateway on the session stack with an API key and room for one
request at a time: 401 without the key, 429 when full (also for a burst arriving at once), and a stream
whose client stops reading (HTTP, or gRPC with its flow-control window closed) is cut, freeing its place."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from dataclasses import dataclass

import grpc
import httpx
import openai
import pytest

from pagedserve.services.common.pb import generate_pb2 as gen
from pagedserve.services.common.pb import generate_pb2_grpc
from tests.e2e.processes import gateway_in_flight, start_gateway, wait_until
from tests.e2e.stalled_grpc import StalledCall
from tests.e2e.test_openai_http import API_KEY, PROMPTS
from tests.e2e.test_stack import QUESTIONS, assert_all_blocks_free

pytestmark = [pytest.mark.e2e, pytest.mark.model]

SEND_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class KeyedGateway:
    http: str  # its HTTP base URL
    address: str  # its gRPC host:port


@pytest.fixture(scope="module")
def keyed_gateway(stack, default_model, tmp_path_factory):
    """A second gateway on the session stack with an API key and room for one request at a time."""
    flags = ("--max-concurrent-requests", "1", "--served-model-name", "smol", "--send-timeout-s", str(SEND_TIMEOUT_S))
    process, address, http = start_gateway("keyed-gateway", stack, default_model,
                                           tmp_path_factory.mktemp("keyed-gateway"), flags,
                                           {"PAGEDSERVE_API_KEY": API_KEY})
    try:
        yield KeyedGateway(http, address)
    finally:
        process.stop()


def test_api_key_is_required_and_a_full_gateway_answers_429(stack, keyed_gateway):
    body = {"model": "smol", "prompt": PROMPTS[1], "max_tokens": 300, "ignore_eos": True, "stream": True}
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        response = httpx.post(keyed_gateway.http + "/v1/completions", json=body, headers=headers, timeout=60)
        assert response.status_code == 401 and response.json()["error"]["code"] == 401
    malformed = httpx.post(keyed_gateway.http + "/v1/completions", content=b"{not json", timeout=60,
                           headers={"Content-Type": "application/json"})
    assert malformed.status_code == 401, malformed.text  # the key is checked before the body is read
    assert httpx.get(keyed_gateway.http + "/health", timeout=10).status_code == 200  # open, like gRPC health
    keyed = openai.OpenAI(base_url=keyed_gateway.http + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    assert [m.id for m in keyed.models.list().data] == ["smol"]
    with httpx.Client(base_url=keyed_gateway.http, timeout=120, headers={"Authorization": f"Bearer {API_KEY}"}) as http:
        with http.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()  # kept: a dropped iterator closes the response
            first = next(lines)  # the one request in flight
            assert first.startswith("data: {") and "error" not in first, first
            refused = http.post("/v1/completions", json={"model": "smol", "prompt": "Hi", "max_tokens": 2})
            assert refused.status_code == 429, refused.text
            assert refused.json()["error"]["type"] == "rate_limit_error"
            assert "has 1 requests in flight; 1 more would pass its limit of 1" in refused.json()["error"]["message"]
    two = httpx.post(keyed_gateway.http + "/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60,
                     json={"model": "smol", "prompt": ["Hi", "Ho"], "max_tokens": 2})
    assert two.status_code == 400 and two.json()["error"]["param"] == "prompt", two.text  # retrying cannot help
    def accepts() -> bool:
        try:
            return keyed.completions.create(model="smol", prompt="Hi", max_tokens=2).choices[0].text is not None
        except openai.RateLimitError:
            return False

    wait_until(accepts, "the keyed gateway accepts again", 30)
    assert_all_blocks_free(stack)


def test_a_burst_at_a_full_gateway_gets_one_answer_and_429_for_the_rest(stack, keyed_gateway):
    # every request of the burst arrives while none is in flight: each would pass a check made before
    # parsing; the limit (1) holds because the gateway checks again where it registers the request
    body = {"model": "smol", "prompt": PROMPTS[1], "max_tokens": 48, "ignore_eos": True}

    async def burst() -> list[int]:
        headers = {"Authorization": f"Bearer {API_KEY}"}
        async with httpx.AsyncClient(base_url=keyed_gateway.http, timeout=120, headers=headers) as http:
            responses = await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(6)))
        return sorted(r.status_code for r in responses)

    assert asyncio.run(burst()) == [200, 429, 429, 429, 429, 429]
    assert_all_blocks_free(stack)


def test_a_stream_whose_client_stops_reading_is_cut_and_frees_its_place(stack, keyed_gateway):
    # echoed prompt logprobs make megabytes at once: the connection's buffers fill, and the gateway's
    # sends wait for a client that never reads
    prompt = " ".join(QUESTIONS)
    body = json.dumps({"model": "smol", "prompt": prompt, "max_tokens": 1000, "ignore_eos": True, "n": 64,
                       "logprobs": 20, "echo": True, "stream": True}).encode()
    port = int(keyed_gateway.http.rsplit(":", 1)[1])
    stalled = socket.socket()
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stalled.connect(("127.0.0.1", port))
    stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    + f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    try:
        wait_until(lambda: gateway_in_flight(keyed_gateway.http) == 1, "the stalled stream in flight", 60)
        started = time.monotonic()
        wait_until(lambda: gateway_in_flight(keyed_gateway.http) == 0, "the stalled stream's place free", 60)
        freed_s = time.monotonic() - started
        stalled.settimeout(30)
        try:  # the gateway aborted the connection: what the client has not read, then the end
            while stalled.recv(1 << 16):
                pass
        except ConnectionResetError:
            pass
        print(f"\nthe stalled stream's place came free {freed_s:.1f} s after it was seen in flight, its connection "
              f"ended {time.monotonic() - started:.1f} s after")
    finally:
        stalled.close()
    assert_all_blocks_free(stack)


def test_a_grpc_call_whose_client_stops_reading_is_cut_and_frees_its_place(stack, keyed_gateway):
    """A client that closed its HTTP/2 window (and answers PINGs) held its place among the gateway's
    requests in flight for as long as it kept the connection: 1,024 of them locked every user out. Now
    its request is aborted (every block free) and its place freed after ``--send-timeout-s``."""
    request = gen.GenerateRequest(prompt="Stalled", sampling_params=gen.SamplingParams(
        max_tokens=400, temperature=0, ignore_eos=True))  # still generating when it is cut: aborted
    host, port = keyed_gateway.address.rsplit(":", 1)
    stalled = StalledCall(host, int(port), "/pagedserve.v1.Generation/Generate", request.SerializeToString(),
                          {"authorization": f"Bearer {API_KEY}"})
    try:
        wait_until(lambda: gateway_in_flight(keyed_gateway.http) == 1, "the stalled call in flight", 60)
        started = time.monotonic()
        wait_until(lambda: gateway_in_flight(keyed_gateway.http) == 0, "the stalled call's place free",
                   SEND_TIMEOUT_S + 30)
        freed_s = time.monotonic() - started
        with grpc.insecure_channel(keyed_gateway.address) as channel:
            answer = list(generate_pb2_grpc.GenerationStub(channel).Generate(
                gen.GenerateRequest(prompt="Hi", sampling_params=gen.SamplingParams(max_tokens=2, temperature=0)),
                metadata=[("authorization", f"Bearer {API_KEY}")], timeout=60))
        assert sum(len(r.token_ids) for r in answer) == 2
        print(f"\nthe stalled call's place came free {freed_s:.1f} s after it was seen in flight")
    finally:
        stalled.close()
    assert_all_blocks_free(stack)
