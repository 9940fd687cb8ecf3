"""What the OpenAI handlers share: the serving context, prompt parsing, merged streams of several
requests, client-disconnect handling and the SSE wire format."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from opentelemetry import trace
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Message, Send

from pagedserve.engine.sampling_params import InvalidRequestError
from pagedserve.text.request_samples import ParsedRequest
from pagedserve.text.tokenizer import PromptTokenizer
from pagedserve.text.tool_parsers import ToolCallParserKind
from pagedserve.services.common import telemetry
from pagedserve.services.gateway.generation_core import GenerationCore, SampleDelta, Submission
from pagedserve.services.gateway.generation_errors import STATUS_OF_ERROR, GenerationError, StatusKind
from pagedserve.services.gateway.openai_protocol import StreamOptions
from pagedserve.services.gateway.openai_responses import UsageInfo

T = TypeVar("T")
log = logging.getLogger("pagedserve.gateway")
SSE_DONE = b"data: [DONE]\n\n"
"""The last event of every stream."""


class ClientDisconnected(Exception):
    """The HTTP client closed the connection before its response was complete."""


@dataclass(frozen=True)
class OpenAIServing:
    """The gateway parts the HTTP handlers use.

    Attributes:
        core: queues requests and streams their text (shared with the gRPC service).
        model_name: the served model name (``model`` must equal it).
        tracer: makes one server span per HTTP request.
        tool_call_parser: how chat answers write tool calls (``--tool-call-parser``).
        send_timeout_s: how long a streamed response waits for its client to read (``--send-timeout-s``).
    """

    core: GenerationCore
    model_name: str
    tracer: trace.Tracer
    tool_call_parser: ToolCallParserKind
    send_timeout_s: float

    def event_stream(self, chunks: AsyncIterator[str]) -> StreamingResponse:
        """The response streaming ``chunks`` as server-sent events, cut when its client stops reading."""
        return _ReadOrCut(chunks, self.send_timeout_s)

    @property
    def tokenizer(self) -> PromptTokenizer:
        return self.core.tokenizer

    def check_model(self, model: str) -> None:
        """Raises ``GenerationError(NOT_FOUND)`` unless ``model`` is the served model name."""
        if model != self.model_name:
            raise GenerationError(StatusKind.NOT_FOUND, f"The model `{model}` does not exist; this server serves "
                                  f"`{self.model_name}`", "model")


class _ReadOrCut(StreamingResponse):
    """Server-sent events whose client must keep reading: a send that waits ``send_timeout_s`` seconds
    (the connection's buffers full) ends the response and closes ``chunks``, which ends its requests
    (aborted in the schedulers). A client that stops reading would otherwise keep its requests, and
    their places among the gateway's requests in flight, until it closes the connection."""

    def __init__(self, chunks: AsyncIterator[str], send_timeout_s: float) -> None:
        super().__init__(chunks, media_type="text/event-stream")
        self._send_timeout_s = send_timeout_s

    async def stream_response(self, send: Send) -> None:
        async def bounded(message: Message) -> None:
            async with asyncio.timeout(self._send_timeout_s):
                await send(message)

        try:
            await super().stream_response(bounded)
        except TimeoutError:  # the connection itself is aborted by http_server.HeaderTimeoutProtocol
            log.warning("an HTTP client read nothing for %g s: its stream is cut and its requests aborted",
                        self._send_timeout_s)
        finally:  # also when the client went away: its requests end now, not when the generator is collected
            await self.body_iterator.aclose()


def invalid(exc: InvalidRequestError) -> GenerationError:
    """An ``InvalidRequestError`` as a ``GenerationError`` of its kind's status (``STATUS_OF_ERROR``:
    ``INVALID_ARGUMENT`` for most kinds), naming its field."""
    return GenerationError(STATUS_OF_ERROR[exc.kind], str(exc), exc.field_name)


async def merged_outputs(core: GenerationCore, submissions: Sequence[Submission]) -> AsyncIterator[tuple[int, SampleDelta]]:
    """The deltas of several requests as they come, each with its request's index in ``submissions``.

    Closing the iteration early (or a failing request) stops every request (each aborts in the
    scheduler). Raises the first ``GenerationError`` of any request.
    """
    streams = [core.generate(s) for s in submissions]
    pending = {asyncio.ensure_future(anext(stream)): i for i, stream in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = pending.pop(task)
                try:
                    sample = task.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(streams[i]))] = i
                yield i, sample
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for stream in streams:
            await stream.aclose()


async def with_first(first: T, rest: AsyncIterator[T]) -> AsyncIterator[T]:
    """``first``, then the items of ``rest`` (an iteration whose first item was taken already)."""
    yield first
    async for item in rest:
        yield item


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body must have been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """``await work``, cancelled when the client goes away first.

    Raises:
        ClientDisconnected: the client closed the connection first (``work`` was cancelled and
            has cleaned up).
    """
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        raise ClientDisconnected()
    finally:
        task.cancel()
        watch.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)


@dataclass(frozen=True)
class StreamUsage:
    """The usage a stream sends, as its ``options`` ask, of prompts of ``prompt_tokens`` tokens each."""

    options: StreamOptions
    prompt_tokens: tuple[int, ...]

    def so_far(self, prompt_index: int, completion_tokens: int) -> UsageInfo | None:
        """A chunk's usage: its choice's so far with ``continuous_usage_stats`` (the tokens of its
        prompt, the ``completion_tokens`` the choice has generated, as vLLM counts them), else None."""
        if not self.options.continuous_usage_stats:
            return None
        return UsageInfo.counts(self.prompt_tokens[prompt_index], completion_tokens)


def sse_event(body: BaseModel) -> bytes:
    """One Server-Sent Event: ``data: <json>`` and a blank line."""
    return b"data: " + body.model_dump_json().encode() + b"\n\n"


def start_span(serving: OpenAIServing, name: str, num_prompts: int) -> trace.Span:
    """The server span of one HTTP request (ended by the caller)."""
    return serving.tracer.start_span(name, kind=trace.SpanKind.SERVER, attributes={"num_prompts": num_prompts})


def submissions_of(parsed: Sequence[ParsedRequest], span: trace.Span, arrived_s: float) -> list[Submission]:
    """One submission per parsed prompt, all traced under ``span``, received at ``arrived_s``
    (``time.monotonic()`` seconds)."""
    context = telemetry.inject(trace.set_span_in_context(span))
    return [Submission(p, context, arrived_s=arrived_s) for p in parsed]


async def open_generation(serving: OpenAIServing, model: str, parse: Callable[[], list[ParsedRequest]],
                          span_name: str) -> tuple[list[ParsedRequest], trace.Span, AsyncIterator[tuple[int, SampleDelta]]]:
    """What every generating endpoint does first: check the model name, parse off the event loop,
    check capacity and the scheduler, open the request's span and queue its prompts.

    Returns:
        The parsed prompts, the span (the caller ends it), and their merged events (``merged_outputs``).

    Raises:
        GenerationError: unknown model (NOT_FOUND), invalid input (INVALID_ARGUMENT, the field named
            as the OpenAI API names it), a full gateway or an unreachable scheduler.
    """
    arrived_s = time.monotonic()
    serving.check_model(model)
    try:
        parsed = await asyncio.to_thread(parse)
    except InvalidRequestError as exc:
        raise invalid(exc) from exc
    serving.core.check_capacity(len(parsed))
    serving.core.check_scheduler()
    span = start_span(serving, span_name, len(parsed))
    return parsed, span, merged_outputs(serving.core, submissions_of(parsed, span, arrived_s))
