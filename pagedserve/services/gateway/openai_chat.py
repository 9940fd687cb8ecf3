"""``POST /v1/chat/completions``: messages through the model's chat template, ``chat.completion``
objects (or ``chat.completion.chunk`` SSE events) out."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from opentelemetry import trace
from starlette.requests import Request
from starlette.responses import Response

from pagedserve.engine.messages import TokenLogprobs
from pagedserve.engine.sampling_params import InvalidRequestError
from pagedserve.text.chat_encoding import ChatPromptMode
from pagedserve.text.request_samples import ParsedRequest, parse_request
from pagedserve.text.tokenizer import CHAT_FIELD, ChatTurn, PromptTokenizer
from pagedserve.text.tool_calls import FunctionTool
from pagedserve.text.tool_parsers import ToolCallParserKind
from pagedserve.services.gateway.generation_core import SampleDelta
from pagedserve.services.gateway.generation_errors import GenerationError, naming_failures
from pagedserve.services.gateway.openai_errors import error_event
from pagedserve.services.gateway.openai_logprobs import ChatLogprobs, TokenNames, chat_logprobs
from pagedserve.services.gateway.openai_samples import collect_samples
from pagedserve.services.gateway.openai_params import sampling_params_from_openai
from pagedserve.services.gateway.openai_structured import structured_output_of
from pagedserve.services.gateway.openai_protocol import ChatCompletionRequest, ChatMessage, StreamOptions
from pagedserve.services.gateway.openai_responses import (
    ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionResponse, DeltaMessage, ResponseMeta, UsageInfo,
)
from pagedserve.services.gateway.openai_serving import (
    SSE_DONE, OpenAIServing, StreamUsage, invalid, open_generation, sse_event, unless_disconnected, with_first,
)
from pagedserve.services.gateway.openai_tools import (
    ToolCallStream, ToolUse, answer_message, finish_reason_of, history_calls, tool_use_of,
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


def encode_messages(tokenizer: PromptTokenizer, messages: Sequence[ChatMessage], mode: ChatPromptMode,
                    tools: Sequence[FunctionTool] = ()) -> list[int]:
    """Token ids of ``messages`` rendered with the chat template, ``tools`` offered.

    Raises:
        InvalidRequestError: field ``messages...`` (no template, bad role, sizes, tool use out of place
            (``ChatTurn.check_tool_use``), the template refused them).
    """
    # OpenAI's "developer" role took over "system"'s job; chat templates know only "system"
    turns = [ChatTurn(role="system" if m.role == "developer" else m.role, content=m.text(),
                      tool_calls=history_calls(m.tool_calls), tool_call_id=m.tool_call_id, name=m.name or None)
             for m in messages]
    for i, turn in enumerate(turns):
        turn.check_tool_use(f"messages[{i}]")
    try:
        return tokenizer.encode_chat(turns, mode, tools)
    except InvalidRequestError as exc:
        name = "messages" + exc.field_name.removeprefix(CHAT_FIELD).removeprefix(".messages")
        raise InvalidRequestError(name, exc.reason) from exc


def parse_chat(body: ChatCompletionRequest, tokenizer: PromptTokenizer, tool_use: ToolUse) -> ParsedRequest:
    """The parsed request (CPU work: run it off the event loop); ``tool_use`` is ``tool_use_of(body)``.

    Raises:
        InvalidRequestError: any invalid field, named as the OpenAI API names it.
    """
    params = tool_use.constrain(sampling_params_from_openai(body))
    mode = chat_prompt_mode(body.add_generation_prompt, body.continue_final_message)
    ids = encode_messages(tokenizer, body.messages, mode, tool_use.tools)
    return parse_request(tokenizer, ids, "messages", params)


async def create_chat_completion(serving: OpenAIServing, body: ChatCompletionRequest, request: Request) -> Response:
    """Serves one chat completions request, streamed or whole.

    Raises:
        GenerationError: the request cannot be served (the HTTP layer maps its kind to a status);
            errors after a stream started are sent as an SSE error event instead.
    """
    serving.check_model(body.model)
    try:
        tool_use = await asyncio.to_thread(tool_use_of, body)
    except InvalidRequestError as exc:
        raise invalid(exc) from exc
    (parsed,), span, events = await open_generation(
        serving, body.model, lambda: [parse_chat(body, serving.tokenizer, tool_use)], "gateway.http.chat_completions")
    events = naming_failures(events, structured_output_of(body)[1] or ("tools" if tool_use.structure else ""))
    meta = ResponseMeta.new("chatcmpl", serving.model_name)
    names = TokenNames(serving.tokenizer) if body.logprobs else None
    answers = _Answers(tool_use, serving.tool_call_parser)
    if not body.stream:
        try:
            return await unless_disconnected(request, _whole(events, meta, parsed, names, answers))
        finally:
            span.end()
    try:
        first = await unless_disconnected(request, anext(events))
    except BaseException:
        span.end()
        raise
    usage = StreamUsage(body.stream_options or StreamOptions(), (len(parsed.prompt_token_ids),))
    return serving.event_stream(_stream(first, events, meta, body.n, names, usage, answers, span))


@dataclass(frozen=True)
class _Answers:
    """How a request's answers are read: its tool use and the parser of calls."""

    tool_use: ToolUse
    parser: ToolCallParserKind

    def stream(self) -> ToolCallStream | None:
        """A choice's call parser while it streams (None: the request parses no calls)."""
        return ToolCallStream(self.parser) if self.tool_use.parses_calls else None


async def _whole(events: AsyncIterator[tuple[int, SampleDelta]], meta: ResponseMeta, parsed: ParsedRequest,
                 names: TokenNames | None, answers: _Answers) -> Response:
    """The whole response; ``names`` None: no logprobs asked for. With ``best_of > n``, the ``n``
    samples of highest cumulative logprob, best first; calls split out of the text when asked."""
    results, usages = await collect_samples(events, [parsed])
    choices = []
    for i, sample in enumerate(results[0].best()):
        message, called = answer_message(sample.text, answers.tool_use, answers.parser)
        choices.append(ChatChoice(index=i, message=message,
                                  logprobs=None if names is None else chat_logprobs(names, sample.logprobs or ()),
                                  finish_reason=finish_reason_of(sample.finish_reason, sample.stop_reason, called),
                                  stop_reason=sample.stop_reason))
    body = ChatCompletionResponse(**meta.fields(), choices=choices, usage=UsageInfo.of(usages))
    return Response(body.model_dump_json(), media_type="application/json")


@dataclass
class _ChoiceStream:
    """One choice while it streams: its call parser (None: no calls parsed) and the logprobs of
    tokens whose text is still held back (they go with the next chunk)."""

    calls: ToolCallStream | None
    logprobs: list[TokenLogprobs] = field(default_factory=list)

    def delta(self, sample: SampleDelta) -> DeltaMessage | None:
        """The delta of ``sample``'s text (None when it completes no text)."""
        self.logprobs += sample.delta.logprobs
        if self.calls is None:
            return DeltaMessage(content=sample.delta.text) if sample.delta.text else None
        content, calls = self.calls.pieces(sample.delta.text, sample.delta.finish_reason is not None)
        return DeltaMessage(content=content or None, tool_calls=calls or None) if content or calls else None

    def take_logprobs(self, names: TokenNames | None) -> ChatLogprobs | None:
        logprobs, self.logprobs = self.logprobs, []
        return None if names is None or not logprobs else chat_logprobs(names, logprobs)


async def _stream(first: tuple[int, SampleDelta], events: AsyncIterator[tuple[int, SampleDelta]], meta: ResponseMeta,
                  n: int, names: TokenNames | None, usage: StreamUsage, answers: _Answers,
                  span: trace.Span) -> AsyncIterator[bytes]:
    """The SSE body: a ``role`` chunk per choice, a chunk per delta that completes text or calls
    (with its tokens' logprobs when asked; none while text is held back), a choice's
    ``finish_reason`` on a chunk of its own with an empty delta (as OpenAI sends it), each with its
    choice's usage so far when asked, the usage chunk when asked, ``[DONE]``."""
    usages = []
    choices = [_ChoiceStream(answers.stream()) for _ in range(n)]
    try:
        for i in range(n):
            role = ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""), finish_reason=None)
            yield sse_event(ChatCompletionChunk(**meta.fields(), choices=[role], usage=usage.so_far(0, 0)))
        async for _, sample in with_first(first, events):
            if sample.usage is not None:
                usages.append(sample.usage)
            state = choices[sample.sample_index]
            delta = state.delta(sample)
            so_far = usage.so_far(0, sample.delta.num_output_tokens)
            if delta is not None:
                choice = ChatChunkChoice(index=sample.sample_index, delta=delta, logprobs=state.take_logprobs(names),
                                         finish_reason=None)
                yield sse_event(ChatCompletionChunk(**meta.fields(), choices=[choice], usage=so_far))
            if sample.delta.finish_reason is not None:
                called = state.calls is not None and state.calls.called
                choice = ChatChunkChoice(index=sample.sample_index, delta=DeltaMessage(),
                                         logprobs=state.take_logprobs(names),
                                         finish_reason=finish_reason_of(sample.delta.finish_reason,
                                                                        sample.delta.stop_reason, called),
                                         stop_reason=sample.delta.stop_reason)
                yield sse_event(ChatCompletionChunk(**meta.fields(), choices=[choice], usage=so_far))
        if usage.options.include_usage:
            yield sse_event(ChatCompletionChunk(**meta.fields(), choices=[], usage=UsageInfo.of(usages)))
    except GenerationError as exc:
        yield error_event(exc)
    finally:
        await events.aclose()
        span.end()
    yield SSE_DONE
