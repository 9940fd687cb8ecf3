"""``POST /v1/completions``: prompts in, ``text_completion`` objects (or SSE chunks) out.

Several prompts are separate engine requests; choice ``index`` is ``prompt_index * n +
sample_index`` (prompt-major, as OpenAI and vLLM number them).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from opentelemetry import trace
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from pagedserve.engine.sampling_params import InvalidRequestError
from pagedserve.text.request_samples import ParsedRequest
from pagedserve.text.tokenizer import TOKEN_IDS_FIELD, PromptTokenizer
from services.gateway.generation_core import GenerationError, SampleDelta
from services.gateway.openai_params import sampling_params_from_openai
from services.gateway.openai_protocol import CompletionRequest
from services.gateway.openai_responses import (
    CompletionChoice, CompletionChunk, CompletionResponse, UsageInfo, ResponseMeta, finish_reason_name,
)
from services.gateway.openai_serving import (
    SSE_DONE, OpenAIServing, invalid, merged_outputs, parsed_request, sse_event, start_span, submissions_of,
    unless_disconnected, with_first,
)
from services.gateway.openai_errors import error_event


def _prompt_ids(tokenizer: PromptTokenizer, prompt: str | list[int], field: str) -> list[int]:
    """Token ids of one prompt (text or ids). Raises InvalidRequestError naming ``field``."""
    try:
        if isinstance(prompt, str):
            return tokenizer.encode_prompt(prompt)
        return tokenizer.check_token_ids(prompt)
    except InvalidRequestError as exc:
        raise InvalidRequestError(field + exc.field_name.removeprefix(TOKEN_IDS_FIELD).removeprefix("prompt"),
                                  exc.reason) from exc


def parse_completion(body: CompletionRequest, tokenizer: PromptTokenizer) -> list[ParsedRequest]:
    """One parsed request per prompt (CPU work: run it off the event loop).

    Raises:
        InvalidRequestError: any invalid field, named as the OpenAI API names it.
    """
    params = sampling_params_from_openai(body)
    prompt = body.prompt
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) or not prompt:
        prompts, fields = [prompt], ["prompt"]
    else:
        prompts, fields = list(prompt), [f"prompt[{i}]" for i in range(len(prompt))]
    return [parsed_request(tokenizer, ids, field, params)
            for ids, field in ((_prompt_ids(tokenizer, p, f), f) for p, f in zip(prompts, fields))]


async def create_completion(serving: OpenAIServing, body: CompletionRequest, request: Request) -> Response:
    """Serves one completions request, streamed or whole.

    Raises:
        GenerationError: the request cannot be served (the HTTP layer maps its kind to a status);
            errors after a stream started are sent as an SSE error event instead.
    """
    arrived_s = time.monotonic()
    serving.check_model(body.model)
    try:
        parsed = await asyncio.to_thread(parse_completion, body, serving.tokenizer)
    except InvalidRequestError as exc:
        raise invalid(exc) from exc
    serving.core.check_capacity(len(parsed))
    serving.core.check_scheduler()
    span = start_span(serving, "gateway.http.completions", len(parsed))
    events = merged_outputs(serving.core, submissions_of(parsed, span, arrived_s))
    meta = ResponseMeta.new("cmpl", serving.model_name)
    if not body.stream:
        try:
            return await unless_disconnected(request, _whole(events, meta, body.n, len(parsed)))
        finally:
            span.end()
    try:
        first = await unless_disconnected(request, anext(events))
    except BaseException:
        span.end()
        raise
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    stream = _stream(first, events, meta, body.n, include_usage, span)
    return StreamingResponse(stream, media_type="text/event-stream")


async def _whole(events: AsyncIterator[tuple[int, SampleDelta]], meta: ResponseMeta, n: int, num_prompts: int) -> Response:
    texts = [[] for _ in range(num_prompts * n)]
    finish: list[str | None] = [None] * len(texts)
    usages = []
    async for prompt_index, sample in events:
        index = prompt_index * n + sample.sample_index
        texts[index].append(sample.delta.text)
        finish[index] = finish_reason_name(sample.delta.finish_reason) or finish[index]
        if sample.usage is not None:
            usages.append(sample.usage)
    choices = [CompletionChoice(index=i, text="".join(t), finish_reason=f) for i, (t, f) in enumerate(zip(texts, finish))]
    body = CompletionResponse(**meta.fields(), choices=choices, usage=UsageInfo.of(usages))
    return Response(body.model_dump_json(), media_type="application/json")


async def _stream(first: tuple[int, SampleDelta], events: AsyncIterator[tuple[int, SampleDelta]], meta: ResponseMeta, n: int,
                  include_usage: bool, span: trace.Span) -> AsyncIterator[bytes]:
    """The SSE body: one chunk per delta, the usage chunk when asked, ``[DONE]``."""
    usages = []
    try:
        async for prompt_index, sample in with_first(first, events):
            if sample.usage is not None:
                usages.append(sample.usage)
            choice = CompletionChoice(index=prompt_index * n + sample.sample_index, text=sample.delta.text,
                                      finish_reason=finish_reason_name(sample.delta.finish_reason))
            yield sse_event(CompletionChunk(**meta.fields(), choices=[choice]))
        if include_usage:
            yield sse_event(CompletionChunk(**meta.fields(), choices=[], usage=UsageInfo.of(usages)))
    except GenerationError as exc:
        yield error_event(exc)
    finally:
        await events.aclose()
        span.end()
    yield SSE_DONE
