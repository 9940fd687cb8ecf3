"""How `bench serve` sends one request and times its stream: over the gateway's gRPC API or its
OpenAI-compatible HTTP API (``/v1/completions`` with ``stream: true``, as vLLM's serving
benchmark's ``openai`` backend does).

Each sender is an async context manager that opens its connection and yields a coroutine
``send(sample, start) -> RequestRecord``; times are s since ``start`` (``time.perf_counter``).
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

from pagedserve.bench.datasets import SampleRequest
from pagedserve.bench.metrics import RequestRecord

Send = Callable[[SampleRequest, float], Awaitable[RequestRecord]]


class Backend(enum.Enum):
    """The API `bench serve` drives: ``grpc`` (Generation.Generate) or ``openai`` (HTTP + SSE)."""

    GRPC = "grpc"
    OPENAI = "openai"


@dataclass(frozen=True)
class SendSettings:
    """What every request of a run asks for, and how long it may take.

    Attributes:
        temperature: sampling temperature (0 is greedy).
        ignore_eos: generate exactly ``max_tokens`` (the sample's expected output length).
        timeout_s: per-request deadline, s.
        api_key: sent as ``authorization: Bearer KEY`` when not empty.
        model_name: the served model name (the OpenAI API's ``model``; unused by gRPC).
        connect_timeout_s: how long to wait for the server before failing the run.
    """

    temperature: float
    ignore_eos: bool
    timeout_s: float
    api_key: str = ""
    model_name: str = ""
    connect_timeout_s: float = 10.0


@asynccontextmanager
async def grpc_sender(target: str, settings: SendSettings) -> AsyncIterator[Send]:
    """Streams ``Generation.Generate`` calls to the gateway at ``target`` (HOST:PORT).

    Raises:
        ConnectionError: the gateway did not answer within ``settings.connect_timeout_s``.
    """
    import grpc

    from pagedserve.services.common.auth import gateway_aio_interceptors
    from pagedserve.services.common.grpc_server import CLIENT_API_CHANNEL_OPTIONS
    from pagedserve.services.common.pb import generate_pb2 as gen
    from pagedserve.services.common.pb import generate_pb2_grpc

    async with grpc.aio.insecure_channel(target, options=CLIENT_API_CHANNEL_OPTIONS,
                                         interceptors=gateway_aio_interceptors(settings.api_key)) as channel:
        try:
            async with asyncio.timeout(settings.connect_timeout_s):
                await channel.channel_ready()
        except TimeoutError as exc:
            raise ConnectionError(f"no gateway answers at {target} after {settings.connect_timeout_s} s") from exc
        stub = generate_pb2_grpc.GenerationStub(channel)

        async def send(sample: SampleRequest, start: float) -> RequestRecord:
            request = gen.GenerateRequest(prompt=sample.prompt, sampling_params=gen.SamplingParams(
                max_tokens=sample.expected_output_len, temperature=settings.temperature,
                ignore_eos=settings.ignore_eos))
            sent = time.perf_counter() - start
            chunk_times: list[float] = []
            tokens, error = 0, None
            try:
                async for response in stub.Generate(request, timeout=settings.timeout_s):
                    if response.token_ids:
                        chunk_times.append(time.perf_counter() - start)
                        tokens += len(response.token_ids)
            except grpc.aio.AioRpcError as exc:
                error = exc.code().name
            except Exception as exc:  # noqa: BLE001 - a benchmark records a failure and goes on
                error = type(exc).__name__
            return RequestRecord(sample.prompt_len, sample.expected_output_len, sent, tuple(chunk_times), tokens, error)

        yield send


def completion_payload(sample: SampleRequest, settings: SendSettings) -> dict:
    """The ``/v1/completions`` body for one sample: streamed, with a final usage chunk."""
    return {"model": settings.model_name, "prompt": sample.prompt, "max_tokens": sample.expected_output_len,
            "temperature": settings.temperature, "ignore_eos": settings.ignore_eos, "stream": True,
            "stream_options": {"include_usage": True}}


@asynccontextmanager
async def openai_sender(base_url: str, settings: SendSettings) -> AsyncIterator[Send]:
    """Streams ``POST {base_url}/v1/completions`` requests (``base_url`` like ``http://127.0.0.1:8000``).

    A chunk whose ``text`` is not empty counts as a token-carrying chunk (as in vLLM's benchmark);
    the output token count comes from the final usage chunk (``stream_options.include_usage``).

    Raises:
        ConnectionError: ``GET {base_url}/health`` did not answer within ``settings.connect_timeout_s``.
    """
    import httpx

    logging.getLogger("httpx").setLevel(logging.WARNING)  # not one INFO line per request
    headers = {"authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base_url.rstrip("/"), headers=headers, limits=limits,
                                 timeout=httpx.Timeout(settings.timeout_s, connect=settings.connect_timeout_s)) as client:
        try:
            await client.get("/health", timeout=settings.connect_timeout_s)
        except httpx.HTTPError as exc:
            raise ConnectionError(f"no HTTP server answers at {base_url}: {exc}") from exc

        async def send(sample: SampleRequest, start: float) -> RequestRecord:
            sent = time.perf_counter() - start
            chunk_times: list[float] = []
            tokens, error = 0, None
            try:
                async with client.stream("POST", "/v1/completions", json=completion_payload(sample, settings)) as reply:
                    if reply.status_code != 200:
                        error = f"HTTP_{reply.status_code}"
                    else:
                        tokens = await _read_completion_stream(reply.aiter_lines(), chunk_times, start)
            except httpx.HTTPError as exc:
                error = type(exc).__name__
            return RequestRecord(sample.prompt_len, sample.expected_output_len, sent, tuple(chunk_times), tokens, error)

        yield send


async def _read_completion_stream(lines: AsyncIterator[str], chunk_times: list[float], start: float) -> int:
    """Reads SSE lines up to ``data: [DONE]``, timing text chunks; returns the usage's completion
    tokens, or the number of text chunks when the server sends no usage (one token per chunk, as
    llama.cpp's server streams)."""
    tokens = None
    async for line in lines:
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        if any(choice.get("text") for choice in chunk.get("choices", ())):
            chunk_times.append(time.perf_counter() - start)
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
    return len(chunk_times) if tokens is None else tokens


def sender(backend: Backend, target: str, settings: SendSettings):
    """The sender for ``backend``: ``target`` is HOST:PORT for gRPC, a base URL for OpenAI."""
    return grpc_sender(target, settings) if backend is Backend.GRPC else openai_sender(target, settings)
