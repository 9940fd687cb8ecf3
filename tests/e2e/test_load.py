"""Load through the real stack: 1,000 concurrent greedy streams, half over gRPC and half over the
OpenAI HTTP API (server-sent events), every one served and each exactly its own text (issues #9, #20).
The stack serves the small random-weight model with the default tokenizer (``small_model``): what is
tested is delivery under load, and its 1,000 prefills cost seconds instead of minutes."""

from __future__ import annotations

import asyncio
import json
import time

import grpc
import httpx
import pytest

from pagedserve.services.common.pb import generate_pb2_grpc
from tests.e2e.test_stack import QUESTIONS, assert_all_blocks_free, chat_request

pytestmark = [pytest.mark.e2e, pytest.mark.model]

STREAMS_PER_API = 500  # 1,000 at once: more than redis-py's default pool of 100 connections
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def short_outputs(small_model):
    """Greedy in-process outputs of MAX_TOKENS tokens for QUESTIONS (the reference)."""
    from pagedserve.engine.sampling_params import SamplingParams
    from pagedserve.llm import LLM
    from pagedserve.text.tokenizer import ChatTurn

    results = LLM(small_model, kv_cache_memory="16MiB").chat([[ChatTurn("user", q)] for q in QUESTIONS], SamplingParams(max_tokens=MAX_TOKENS,
                                                                                           temperature=0.0))
    return dict(zip(QUESTIONS, results))


async def _grpc_stream(stub: generate_pb2_grpc.GenerationStub, i: int) -> tuple[str, list[int] | str]:
    question = QUESTIONS[i % len(QUESTIONS)]
    request = chat_request(question, max_tokens=MAX_TOKENS)
    request.request_id = f"label-{i % 4}"  # labels shared by many calls
    try:
        return question, [t async for r in stub.Generate(request, timeout=600) for t in r.token_ids]
    except grpc.RpcError as exc:
        return question, f"gRPC {exc.code().name}: {exc.details()}"


async def _http_stream(http: httpx.AsyncClient, model: str, i: int) -> tuple[str, str | None, str]:
    """(question, streamed text, failure or "")."""
    question = QUESTIONS[i % len(QUESTIONS)]
    body = {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": MAX_TOKENS,
            "temperature": 0, "stream": True}
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                return question, None, f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
            text, done = [], False
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    chunk = json.loads(line[len("data: "):])
                    if "error" in chunk:
                        return question, None, f"SSE error {chunk['error']}"
                    text.extend(c["delta"].get("content") or "" for c in chunk["choices"])
            return question, "".join(text), "" if done else "no [DONE]"
    except httpx.HTTPError as exc:
        return question, None, f"{type(exc).__name__}: {exc}"


async def _run_mixed_load(stack, model: str) -> tuple[list, list]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with grpc.aio.insecure_channel(stack.gateway) as channel, \
            httpx.AsyncClient(base_url=stack.http, timeout=600, limits=limits) as http:
        stub = generate_pb2_grpc.GenerationStub(channel)
        grpc_calls = [_grpc_stream(stub, i) for i in range(STREAMS_PER_API)]
        http_calls = [_http_stream(http, model, i) for i in range(STREAMS_PER_API)]
        results = await asyncio.gather(*grpc_calls, *http_calls)
    return results[:STREAMS_PER_API], results[STREAMS_PER_API:]


def test_1000_concurrent_grpc_and_http_streams_all_get_exactly_their_own_tokens(small_stack, short_outputs, small_model):
    stack = small_stack
    assert len({tuple(o.token_ids) for o in short_outputs.values()}) >= len(QUESTIONS) // 2  # mixing would show
    started = time.monotonic()
    grpc_results, http_results = asyncio.run(_run_mixed_load(stack, small_model.name))
    elapsed = time.monotonic() - started
    failures = [r for _, r in grpc_results if isinstance(r, str)] + [f for _, _, f in http_results if f]
    mixed = [q for q, r in grpc_results if not isinstance(r, str) and r != list(short_outputs[q].token_ids)]
    mixed += [q for q, text, f in http_results if not f and text != short_outputs[q].text]
    print(f"\n{2 * STREAMS_PER_API} concurrent streams (half gRPC, half HTTP) in {elapsed:.1f} s: {len(failures)} "
          f"failed, {len(mixed)} with other tokens than their own; failures: {sorted(set(failures))[:5]}")
    assert failures == [] and mixed == [], stack.logs()  # the services' logs: where a CANCELLED came from
    assert_all_blocks_free(stack)
