"""The Generation gRPC service: validate, tokenize, enqueue, then stream text deltas back."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

import grpc
import redis
from opentelemetry import trace

from services.common import telemetry
from pagedserve.engine.messages import EngineRequest, FinishReason, RequestOutput, TokenLogprobs
from services.common.pb import generate_pb2 as gen
from services.common.pb import generate_pb2_grpc
from pagedserve.engine.sampling_params import InvalidRequestError
from pagedserve.text.output_processor import TextDelta
from services.gateway.metrics import GatewayMetrics, RequestMetrics
from services.gateway.queue_producer import RequestQueueProducer
from services.gateway.request_parser import ParsedRequest, parse_generate_request
from pagedserve.text.request_samples import RequestSamples
from services.gateway.router import OutputRouter
from pagedserve.text.tokenizer import PromptTokenizer

_FINISH_TO_PB = {
    FinishReason.STOP: gen.FINISH_REASON_STOP,
    FinishReason.LENGTH: gen.FINISH_REASON_LENGTH,
    FinishReason.ABORT: gen.FINISH_REASON_ABORT,
}
_STATUS_BY_CODE = {status.value[0]: status for status in grpc.StatusCode}
LOST_CHECK_S = 5
"""How often a request no scheduler has taken yet checks that its stream entry still exists, seconds."""


def _logprobs_pb(entry: TokenLogprobs) -> gen.TokenLogprobs:
    """One position's logprobs as the client API's message."""
    return gen.TokenLogprobs(token_id=entry.token_id, logprob=entry.logprob, rank=entry.rank,
                             top_token_ids=entry.top_token_ids, top_logprobs=entry.top_logprobs)


class GenerationServicer(generate_pb2_grpc.GenerationServicer):
    """Serves Generate. Each call registers for its token events before the request is queued.

    Args:
        max_concurrent_requests: calls in flight above which new ones get RESOURCE_EXHAUSTED.
        scheduler_grace_s: how long a call waits for a lost scheduler stream to come back before
            failing with UNAVAILABLE.
        metrics: where the calls' latencies and tokens are counted.
    """

    def __init__(
        self,
        tokenizer: PromptTokenizer,
        producer: RequestQueueProducer,
        router: OutputRouter,
        tracer: trace.Tracer,
        max_concurrent_requests: int,
        metrics: GatewayMetrics,
        scheduler_grace_s: float = 10.0,
    ) -> None:
        self._tokenizer = tokenizer
        self._producer = producer
        self._router = router
        self._tracer = tracer
        self._max_concurrent = max_concurrent_requests
        self._grace_s = scheduler_grace_s
        self._metrics = metrics
        self._background: set[asyncio.Task] = set()

    async def Generate(self, request: gen.GenerateRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[gen.GenerateResponse]:
        """Validates, queues and streams one request (see proto/generate.proto for the statuses)."""
        request_metrics = self._metrics.start_request()
        if self._router.num_in_flight >= self._max_concurrent:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"the gateway has {self._max_concurrent} requests in flight; retry later")
        try:
            parsed = await asyncio.to_thread(parse_generate_request, request, self._tokenizer)  # off the event loop
        except InvalidRequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if self._router.disconnected_for_s() > self._grace_s:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the scheduler is unreachable; retry later")
        # The request's identity across gateway, Redis and scheduler is made here, new for every
        # submission: the client's request_id is only a label, so a reused one can never receive
        # another submission's tokens.
        key = uuid.uuid4().hex
        label = request.request_id or key
        parent = telemetry.extract(telemetry.metadata_to_carrier(context.invocation_metadata()))
        # Not made the current span: an async generator that yields must not attach contexts.
        span = self._tracer.start_span("gateway.Generate", context=parent, kind=trace.SpanKind.SERVER,
                                       attributes={"request_id": key, "client_request_id": label,
                                                   "prompt_tokens": len(parsed.prompt_token_ids)})
        try:
            async for response in self._generate(key, label, parsed, span, context, request_metrics):
                yield response
        finally:
            span.end()

    async def _generate(self, key: str, label: str, parsed: ParsedRequest, span: trace.Span,
                        context: grpc.aio.ServicerContext,
                        request_metrics: RequestMetrics) -> AsyncIterator[gen.GenerateResponse]:
        outputs = self._router.register(key)
        state = RequestSamples(self._tokenizer, parsed.prompt_token_ids, parsed.params)
        entry_id: bytes | None = None
        try:
            engine_request = EngineRequest(key, parsed.prompt_token_ids, parsed.engine_params, time.time(),
                                           telemetry.inject(trace.set_span_in_context(span)), parsed.priority,
                                           parsed.cache_salt)
            try:
                entry_id = await self._producer.enqueue(engine_request)
            except redis.RedisError as exc:
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"cannot queue the request (Redis: {exc}); retry later")
            accepted = False  # until the scheduler's first event: the request may still be lost with Redis
            while not state.finished:
                output = await self._next_output(outputs, context, None if accepted else entry_id)
                accepted = True
                if output.error is not None:
                    await context.abort(_STATUS_BY_CODE.get(output.error.grpc_code, grpc.StatusCode.UNAVAILABLE),
                                        output.error.message)
                try:
                    delta = state.process(output)
                except ValueError as exc:  # tokens missing from the stream: the request cannot go on exactly
                    await context.abort(grpc.StatusCode.ABORTED, f"the token stream broke ({exc}); retry")
                request_metrics.delta(output.sample_index, delta, state.num_prompt_tokens)
                if delta.stop_string_matched:
                    self._abort_in_background(key, output.sample_index)
                if delta.text or delta.token_ids or delta.finish_reason:
                    yield self._response(label, output.sample_index, delta, state)
        finally:
            self._router.unregister(key)
            if not state.finished:  # the client went away or the call failed: nothing may run for it
                self._abort_in_background(key, forget_entry=entry_id)

    async def _next_output(self, outputs: asyncio.Queue[RequestOutput], context: grpc.aio.ServicerContext,
                           unread_entry: bytes | None) -> RequestOutput:
        """The next event. Fails with UNAVAILABLE when the scheduler stream stays lost too long, or
        when ``unread_entry`` (the request's stream entry, while no scheduler has taken it) has
        vanished from Redis (Redis restarted empty): then no scheduler will ever run it."""
        waited_s = 0
        while True:
            try:
                return await asyncio.wait_for(outputs.get(), timeout=1.0)
            except asyncio.TimeoutError:
                waited_s += 1
                if self._router.disconnected_for_s() > self._grace_s:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "lost the connection to the scheduler")
                if unread_entry is not None and waited_s % LOST_CHECK_S == 0 and await self._producer.lost(unread_entry):
                    await context.abort(grpc.StatusCode.UNAVAILABLE,
                                        "the request was lost before a scheduler took it (Redis restarted?); retry")

    @staticmethod
    def _response(request_id: str, sample_index: int, delta: TextDelta, state: RequestSamples) -> gen.GenerateResponse:
        response = gen.GenerateResponse(request_id=request_id, text=delta.text, token_ids=delta.token_ids,
                                        index=sample_index, logprobs=[_logprobs_pb(e) for e in delta.logprobs])
        if delta.prompt_logprobs is not None:
            response.prompt_logprobs.positions.extend(_logprobs_pb(e) for e in delta.prompt_logprobs[1:])
        if isinstance(delta.stop_reason, str):
            response.stop_string = delta.stop_reason
        elif delta.stop_reason is not None:
            response.stop_token_id = delta.stop_reason
        if delta.finish_reason is not None:
            response.finish_reason = _FINISH_TO_PB[delta.finish_reason]
        if state.finished:
            response.usage.prompt_tokens = state.num_prompt_tokens
            response.usage.completion_tokens = state.num_output_tokens
        return response

    def _abort_in_background(self, key: str, sample_index: int | None = None, forget_entry: bytes | None = None) -> None:
        """Aborts in the scheduler without waiting (safe while the call is being cancelled); with
        ``forget_entry``, also deletes the request's stream entry so that a scheduler restarted
        later does not run it for nobody."""
        loop = asyncio.get_running_loop()
        tasks = [loop.create_task(self._router.abort(key, sample_index))]
        if forget_entry is not None:
            tasks.append(loop.create_task(self._producer.forget(forget_entry)))
        for task in tasks:
            self._background.add(task)
            task.add_done_callback(self._background.discard)
