"""The Generation gRPC service: a thin shell over ``GenerationCore`` (parse, then stream deltas)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time

import grpc
from opentelemetry import trace

from pagedserve.services.common import telemetry
from pagedserve.engine.messages import TokenLogprobs
from pagedserve.services.common.pb import generate_pb2 as gen
from pagedserve.services.common.pb import generate_pb2_grpc
from pagedserve.engine.sampling_params import InvalidRequestError
from pagedserve.text.tool_parsers import ToolCallParserKind
from pagedserve.text.tool_use import ToolUse
from pagedserve.services.gateway.generation_core import GenerationCore, SampleDelta, Submission
from pagedserve.services.gateway.generation_errors import STATUS_OF_ERROR, GenerationError, StatusKind, naming_failures
from pagedserve.services.gateway.grpc_tools import SampleCalls
from pagedserve.services.gateway.request_parser import parse_generate_request

log = logging.getLogger("pagedserve.gateway")

_STATUS_BY_CODE = {status.value[0]: status for status in grpc.StatusCode}


def grpc_status(kind: StatusKind) -> grpc.StatusCode:
    """The gRPC status code of a ``StatusKind`` (they share the canonical numbering)."""
    return _STATUS_BY_CODE.get(kind.value, grpc.StatusCode.UNKNOWN)


def _logprobs_pb(entry: TokenLogprobs) -> gen.TokenLogprobs:
    """One position's logprobs as the client API's message."""
    return gen.TokenLogprobs(token_id=entry.token_id, logprob=entry.logprob, rank=entry.rank,
                             top_token_ids=entry.top_token_ids, top_logprobs=entry.top_logprobs)


def _structure_field(request: gen.GenerateRequest, tool_use: ToolUse) -> str:
    """The request's field that asked for a structured output ("" for none): its member of
    ``sampling_params.structured_output``, or ``chat.tools`` whose calls a tool choice constrains to."""
    member = request.sampling_params.structured_output.WhichOneof("kind")
    if member is not None:
        return f"sampling_params.structured_output.{member}"
    return "chat.tools" if tool_use.structure is not None else ""


async def _finished(write: asyncio.Future, timeout_s: float) -> bool:
    """Whether ``write`` finished within ``timeout_s`` seconds; cancelled with the caller."""
    try:
        done, _ = await asyncio.wait({write}, timeout=timeout_s)
    except asyncio.CancelledError:  # the client went away
        write.cancel()
        raise
    return bool(done)


class GenerationServicer(generate_pb2_grpc.GenerationServicer):
    """Serves Generate over ``core``: validation errors are INVALID_ARGUMENT, a full gateway is
    RESOURCE_EXHAUSTED, and a core ``GenerationError`` ends the call with its kind's status.

    Args:
        core: the transport-neutral generation core (shared with the HTTP API).
        tracer: makes the call's server span.
        tool_call_parser: how chat answers write tool calls (``--tool-call-parser``).
        send_timeout_s: how long a response may wait for its client to read (``--send-timeout-s``): past
            it the call's requests are aborted and it ends RESOURCE_EXHAUSTED (a client that stops
            reading, its HTTP/2 flow-control window closed, would otherwise hold its places among the
            gateway's requests in flight for as long as it kept the connection).
    """

    def __init__(self, core: GenerationCore, tracer: trace.Tracer, tool_call_parser: ToolCallParserKind,
                 send_timeout_s: float) -> None:
        self._core = core
        self._tracer = tracer
        self._tool_call_parser = tool_call_parser
        self._send_timeout_s = send_timeout_s

    async def Generate(self, request: gen.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        """Validates, queues and streams one request (see proto/generate.proto for the statuses)."""
        arrived_s = time.monotonic()
        try:
            self._core.check_capacity()
            try:
                given = await asyncio.to_thread(parse_generate_request, request, self._core.tokenizer)  # off the loop
            except InvalidRequestError as exc:
                raise GenerationError(STATUS_OF_ERROR[exc.kind], str(exc), exc.field_name) from exc
            self._core.check_scheduler()
        except GenerationError as exc:
            await context.abort(grpc_status(exc.kind), exc.message)
        parent = telemetry.extract(telemetry.metadata_to_carrier(context.invocation_metadata()))
        submission = Submission(given.parsed, arrived_s=arrived_s)
        label = request.request_id or submission.key
        # Not made the current span: the handler awaits between writes and must not attach contexts.
        span = self._tracer.start_span("gateway.Generate", context=parent, kind=trace.SpanKind.SERVER,
                                       attributes={"request_id": submission.key, "client_request_id": label,
                                                   "prompt_tokens": len(submission.parsed.prompt_token_ids)})
        submission = dataclasses.replace(submission, trace_context=telemetry.inject(trace.set_span_in_context(span)))
        calls = SampleCalls(given.tool_use, self._tool_call_parser)
        stalled = None
        try:
            named = naming_failures(self._core.generate(submission), _structure_field(request, given.tool_use))
            async with contextlib.aclosing(named):  # a cut stream's requests end now (aborted in the scheduler)
                async for sample in named:
                    stalled = await self._write(context, self._response(label, sample, calls))
                    if stalled is not None:
                        break
            if stalled is not None:
                await self._end_stalled(context, stalled)
        except GenerationError as exc:
            await context.abort(grpc_status(exc.kind), exc.message)
        finally:
            span.end()

    async def _write(self, context: grpc.aio.ServicerContext, response: gen.GenerateResponse) -> asyncio.Future | None:
        """Writes ``response``; returns the write, still waiting, when the client has not taken it within
        ``send_timeout_s`` (its flow-control window closed), else ``None``. (Cancelled, the write would stay
        queued in gRPC's core, and ending the call then fails to send its status.)"""
        write = asyncio.ensure_future(context.write(response))
        write.add_done_callback(lambda w: w.cancelled() or w.exception())  # retrieved whatever happens next
        if await _finished(write, self._send_timeout_s):
            write.result()
            return None
        log.warning("a gRPC client read nothing for %g s: its requests are aborted and its place freed",
                    self._send_timeout_s)
        return write

    async def _end_stalled(self, context: grpc.aio.ServicerContext, write: asyncio.Future) -> None:
        """Ends a call whose requests were aborted while ``write`` waited: RESOURCE_EXHAUSTED once the
        client takes the message (so that it cannot pass for a short answer); if it has not within another
        ``send_timeout_s``, the write is cancelled and the call left to end with its connection (gRPC
        cannot send a status behind a queued message: ``generation_handler.StalledCallErrors`` drops its
        traceback)."""
        if not await _finished(write, self._send_timeout_s):
            write.cancel()
            return
        write.result()
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"the client read nothing for {self._send_timeout_s:g} "
                            "s (--send-timeout-s): the stream was cut and its requests aborted")

    @staticmethod
    def _response(request_id: str, sample: SampleDelta, calls: SampleCalls) -> gen.GenerateResponse:
        delta = sample.delta
        response = gen.GenerateResponse(request_id=request_id, text=delta.text, token_ids=delta.token_ids,
                                        index=sample.sample_index, logprobs=[_logprobs_pb(e) for e in delta.logprobs])
        if delta.prompt_logprobs is not None:
            response.prompt_logprobs.positions.extend(_logprobs_pb(e) for e in delta.prompt_logprobs[1:])
        if isinstance(delta.stop_reason, str):
            response.stop_string = delta.stop_reason
        elif delta.stop_reason is not None:
            response.stop_token_id = delta.stop_reason
        calls.fill(response, delta.finish_reason)
        if sample.usage is not None:
            response.usage.prompt_tokens = sample.usage.prompt_tokens
            response.usage.completion_tokens = sample.usage.completion_tokens
        return response
