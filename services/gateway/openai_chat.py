"""``POST /v1/chat/completions``: messages through the model's chat template, ``chat.completion``
objects (or ``chat.completion.chunk`` SSE events) out."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

import jinja2
from opentelemetry import trace
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from pagedserve.engine.sampling_params import InvalidRequestError
from pagedserve.text.chat_encoding import ChatPromptMode
from pagedserve.text.request_samples import ParsedRequest, parse_request
from pagedserve.text.tokenizer import CHAT_FIELD, ChatTurn, PromptTokenizer
from services.gateway.generation_core import GenerationError, SampleDelta
from services.gateway.openai_errors import error_event
from services.gateway.openai_logprobs import TokenNames, chat_logprobs
from services.gateway.openai_samples import collect_samples
from services.gateway.openai_params import sampling_params_from_openai
from services.gateway.openai_protocol import ChatCompletionRequest, ChatMessage
from services.gateway.openai_responses import (
    ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionResponse, ChatMessageOut, DeltaMessage,
    UsageInfo, ResponseMeta, finish_reason_name,
)
from services.gateway.openai_serving import (
    SSE_DONE, OpenAIServing, open_generation, sse_event, unless_disconnected, with_first,
)


def chat_prompt_mode(add_generation_prompt: bool, continue_final_message: bool) -> ChatPromptMode:
    """The template ending the two OpenAI/vLLM flags ask for.

    Raises:
        InvalidRequestError: both set (``continue_final_message``).
    """
    if continue_final_message and add_generation_prompt:
        raise InvalidRequestError("continue_final_message",
                                  "cannot be true together with add_generation_prompt (set that to false)")
    if continue_final_message:
        return ChatPromptMode.CONTINUE_FINAL_MESSAGE
    if add_generation_prompt:
        return ChatPromptMode.OPEN_ASSISTANT_TURN
    return ChatPromptMode.NO_GENERATION_PROMPT


def encode_messages(tokenizer: PromptTokenizer, messages: Sequence[ChatMessage], mode: ChatPromptMode) -> list[int]:
    """Token ids of ``messages`` rendered with the chat template.

    Raises:
        InvalidRequestError: field ``messages...`` (no template, bad role, sizes, a template error).
    """
    # OpenAI's "developer" role took over "system"'s job; chat templates know only "system"
    turns = [ChatTurn(role="system" if m.role == "developer" else m.role, content=m.text()) for m in messages]
    try:
        return tokenizer.encode_chat(turns, mode)
    except InvalidRequestError as exc:
        name = "messages" + exc.field_name.removeprefix(CHAT_FIELD).removeprefix(".messages")
        raise InvalidRequestError(name, exc.reason) from exc
    except (ValueError, jinja2.TemplateError) as exc:  # the template refused the conversation
        raise InvalidRequestError("messages", f"the chat template refused them: {exc}") from exc


def parse_chat(body: ChatCompletionRequest, tokenizer: PromptTokenizer) -> ParsedRequest:
    """The parsed request (CPU work: run it off the event loop).

    Raises:
        InvalidRequestError: any invalid field, named as the OpenAI API names it.
    """
    params = sampling_params_from_openai(body)
    mode = chat_prompt_mode(body.add_generation_prompt, body.continue_final_message)
    return parse_request(tokenizer, encode_messages(tokenizer, body.messages, mode), "messages", params)


async def create_chat_completion(serving: OpenAIServing, body: ChatCompletionRequest, request: Request) -> Response:
    """Serves one chat completions request, streamed or whole.

    Raises:
        GenerationError: the request cannot be served (the HTTP layer maps its kind to a status);
            errors after a stream started are sent as an SSE error event instead.
    """
    (parsed,), span, events = await open_generation(serving, body.model, lambda: [parse_chat(body, serving.tokenizer)],
                                                    "gateway.http.chat_completions")
    meta = ResponseMeta.new("chatcmpl", serving.model_name)
    names = TokenNames(serving.tokenizer) if body.logprobs else None
    if not body.stream:
        try:
            return await unless_disconnected(request, _whole(events, meta, parsed, names))
        finally:
            span.end()
    try:
        first = await unless_disconnected(request, anext(events))
    except BaseException:
        span.end()
        raise
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    return StreamingResponse(_stream(first, events, meta, body.n, names, include_usage, span),
                             media_type="text/event-stream")


async def _whole(events: AsyncIterator[tuple[int, SampleDelta]], meta: ResponseMeta, parsed: ParsedRequest,
                 names: TokenNames | None) -> Response:
    """The whole response; ``names`` None: no logprobs asked for. With ``best_of > n``, the ``n``
    samples of highest cumulative logprob, best first."""
    results, usages = await collect_samples(events, [parsed])
    choices = [ChatChoice(index=i, message=ChatMessageOut(content=sample.text),
                          logprobs=None if names is None else chat_logprobs(names, sample.logprobs or ()),
                          finish_reason=finish_reason_name(sample.finish_reason), stop_reason=sample.stop_reason)
               for i, sample in enumerate(results[0].best())]
    body = ChatCompletionResponse(**meta.fields(), choices=choices, usage=UsageInfo.of(usages))
    return Response(body.model_dump_json(), media_type="application/json")


async def _stream(first: tuple[int, SampleDelta], events: AsyncIterator[tuple[int, SampleDelta]], meta: ResponseMeta, n: int,
                  names: TokenNames | None, include_usage: bool, span: trace.Span) -> AsyncIterator[bytes]:
    """The SSE body: a ``role`` chunk per choice, one chunk per delta (with its tokens' logprobs
    when asked), the usage chunk when asked, ``[DONE]``."""
    usages = []
    try:
        for i in range(n):
            role = ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""), finish_reason=None)
            yield sse_event(ChatCompletionChunk(**meta.fields(), choices=[role]))
        async for _, sample in with_first(first, events):
            if sample.usage is not None:
                usages.append(sample.usage)
            delta = DeltaMessage(content=sample.delta.text or None)
            logprobs = None if names is None else chat_logprobs(names, sample.delta.logprobs)
            choice = ChatChunkChoice(index=sample.sample_index, delta=delta, logprobs=logprobs,
                                     finish_reason=finish_reason_name(sample.delta.finish_reason),
                                     stop_reason=sample.delta.stop_reason)
            yield sse_event(ChatCompletionChunk(**meta.fields(), choices=[choice]))
        if include_usage:
            yield sse_event(ChatCompletionChunk(**meta.fields(), choices=[], usage=UsageInfo.of(usages)))
    except GenerationError as exc:
        yield error_event(exc)
    finally:
        await events.aclose()
        span.end()
    yield SSE_DONE
