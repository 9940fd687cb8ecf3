"""The Generation gRPC service: a thin shell over ``GenerationCore`` (parse, then stream deltas)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator

import grpc
from opentelemetry import trace

from services.common import telemetry
from pagedserve.engine.messages import TokenLogprobs
from services.common.pb import generate_pb2 as gen
from services.common.pb import generate_pb2_grpc
from pagedserve.engine.sampling_params import InvalidRequestError
from pagedserve.text.tool_parsers import ToolCallParserKind
from pagedserve.text.tool_use import ToolUse
from services.gateway.generation_core import GenerationCore, SampleDelta, Submission
from services.gateway.generation_errors import STATUS_OF_ERROR, GenerationError, StatusKind, naming_failures
from services.gateway.grpc_tools import SampleCalls
from services.gateway.request_parser import parse_generate_request

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


class GenerationServicer(generate_pb2_grpc.GenerationServicer):
    """Serves Generate over ``core``: validation errors are INVALID_ARGUMENT, a full gateway is
    RESOURCE_EXHAUSTED, and a core ``GenerationError`` ends the call with its kind's status.

    Args:
        core: the transport-neutral generation core (shared with the HTTP API).
        tracer: makes the call's server span.
        tool_call_parser: how chat answers write tool calls (``--tool-call-parser``).
    """

    def __init__(self, core: GenerationCore, tracer: trace.Tracer, tool_call_parser: ToolCallParserKind) -> None:
        self._core = core
        self._tracer = tracer
        self._tool_call_parser = tool_call_parser

    async def Generate(self, request: gen.GenerateRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[gen.GenerateResponse]:
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
        # Not made the current span: an async generator that yields must not attach contexts.
        span = self._tracer.start_span("gateway.Generate", context=parent, kind=trace.SpanKind.SERVER,
                                       attributes={"request_id": submission.key, "client_request_id": label,
                                                   "prompt_tokens": len(submission.parsed.prompt_token_ids)})
        submission = dataclasses.replace(submission, trace_context=telemetry.inject(trace.set_span_in_context(span)))
        calls = SampleCalls(given.tool_use, self._tool_call_parser)
        try:
            named = naming_failures(self._core.generate(submission), _structure_field(request, given.tool_use))
            async for sample in named:
                yield self._response(label, sample, calls)
        except GenerationError as exc:
            await context.abort(grpc_status(exc.kind), exc.message)
        finally:
            span.end()

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
