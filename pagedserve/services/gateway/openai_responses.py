"""Response bodies of the OpenAI-compatible HTTP API (pydantic), shaped as OpenAI sends them.

``finish_reason`` is always present (``null`` until a choice's last chunk); ``usage`` is
``null`` in stream chunks except the ``include_usage`` chunk, whose ``choices`` is empty, and
every chunk with ``continuous_usage_stats`` (its choice's usage so far). A chat message has no
``tool_calls`` key unless it made calls (as OpenAI sends it).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import asdict, dataclass
from typing import Literal

from pydantic import BaseModel, Field, model_serializer

from pagedserve.engine.messages import FinishReason
from pagedserve.services.gateway.generation_core import Usage
from pagedserve.services.gateway.openai_logprobs import ChatLogprobs, CompletionLogprobs, PromptLogprob

def finish_reason_name(reason: FinishReason | None) -> str | None:
    """OpenAI's ``finish_reason`` string (None while the choice runs): the enum's values are OpenAI's."""
    return None if reason is None else reason.value


def new_id(prefix: str) -> str:
    """A response id such as ``cmpl-<32 hex>``."""
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    """The ``created`` timestamp: Unix time in whole seconds."""
    return int(time.time())


@dataclass(frozen=True)
class ResponseMeta:
    """What every object and chunk of one response repeats: ``id``, ``created`` (Unix seconds), ``model``."""

    id: str
    created: int
    model: str

    @classmethod
    def new(cls, prefix: str, model: str) -> ResponseMeta:
        """A fresh id (``cmpl``, ``chatcmpl``) made now."""
        return cls(new_id(prefix), now_s(), model)

    def fields(self) -> dict:
        return asdict(self)


class UsageInfo(BaseModel):
    """Token counts; ``completion_tokens`` sums every choice."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, usages: list[Usage]) -> UsageInfo:
        """The usage of several engine requests (one per prompt) together."""
        return cls.counts(sum(u.prompt_tokens for u in usages), sum(u.completion_tokens for u in usages))

    @classmethod
    def counts(cls, prompt_tokens: int, completion_tokens: int) -> UsageInfo:
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


class CompletionChoice(BaseModel):
    """A completions choice (of a stream chunk: only that chunk's text and tokens).

    ``stop_reason`` (vLLM's extension): the stop string that matched, or the stop token id that
    ended the choice; null for EOS, length, or while the choice runs."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None
    stop_reason: str | int | None = None


class CompletionWholeChoice(CompletionChoice):
    """A non-streamed completions choice: with ``prompt_logprobs`` (vLLM's extension, see
    ``openai_logprobs``; null unless asked for)."""

    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionWholeChoice]
    usage: UsageInfo


class CompletionChunk(BaseModel):
    """One SSE event of a streamed completion (same ``object`` as the whole response, as OpenAI does)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class FunctionCallOut(BaseModel):
    """A call's function: ``arguments`` is JSON text, as the model wrote it."""

    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatMessageOut(BaseModel):
    """The answer: ``content`` is the text outside the tool calls (null when there is none);
    ``tool_calls`` only when it made calls (the key is left out otherwise, as OpenAI does)."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = None

    @model_serializer(mode="wrap")
    def _without_no_calls(self, handler) -> dict:
        out = handler(self)
        if out["tool_calls"] is None:
            del out["tool_calls"]
        return out


class ChatChoice(BaseModel):
    """A chat choice; ``stop_reason`` as in ``CompletionChoice``."""

    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None
    stop_reason: str | int | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


def _set_keys(self: BaseModel, handler) -> dict:
    """Only the keys that are not None (a choice's last delta is ``{}``, as OpenAI sends it)."""
    return {key: value for key, value in handler(self).items() if value is not None}


class DeltaFunction(BaseModel):
    """A streamed call's function: ``name`` on the call's first chunk, then ``arguments`` in pieces."""

    name: str | None = None
    arguments: str | None = None

    _drop_unset = model_serializer(mode="wrap")(_set_keys)


class DeltaToolCall(BaseModel):
    """A piece of call ``index``: ``id``, ``type`` and ``function.name`` on its first piece only."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunction

    _drop_unset = model_serializer(mode="wrap")(_set_keys)


class DeltaMessage(BaseModel):
    """A chat chunk's delta: ``role`` on a choice's first chunk only, ``content`` when it has text,
    ``tool_calls`` when it has pieces of calls."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    _drop_unset = model_serializer(mode="wrap")(_set_keys)


class ChatChunkChoice(BaseModel):
    """A chat chunk's choice: ``logprobs`` of that chunk's tokens when asked for."""

    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None
    stop_reason: str | int | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pagedserve"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo = Field(description="what went wrong")
