"""Tool calls on the HTTP chat API: the request fields (``tools``, ``tool_choice``,
``parallel_tool_calls``, and tool use in the history) and the calls found in an answer, in OpenAI's
shapes. What the fields ask of the engine is ``pagedserve.text.tool_use``'s, shared with gRPC.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr

from pagedserve.engine.messages import FinishReason
from pagedserve.text import tool_use
from pagedserve.text.request_limits import RequestLimits
from pagedserve.text.tool_calls import FunctionTool, ToolCall
from pagedserve.text.tool_use import (
    FUNCTION_NAME_PATTERN, PARALLEL_TOOL_CALLS_DEFAULT, ToolChoiceMode, ToolFieldNames, ToolUse, ended_by_calls,
    new_call_id,
)
from pagedserve.text.tool_parsers import (
    PARSERS, ArgumentsPiece, CallCut, CallStart, ContentPiece, ToolCallParserKind, parse_tool_calls,
)
from pagedserve.services.gateway.openai_responses import (
    ChatMessageOut, DeltaFunction, DeltaToolCall, FunctionCallOut, ToolCallOut, finish_reason_name,
)

_LIMITS = RequestLimits()
FunctionName = Annotated[StrictStr, Field(min_length=1, max_length=_LIMITS.max_function_name_chars,
                                          pattern=FUNCTION_NAME_PATTERN)]
Description = Annotated[StrictStr, Field(max_length=_LIMITS.max_tool_description_chars)]
Arguments = Annotated[StrictStr, Field(max_length=_LIMITS.max_tool_arguments_chars)]
CallId = Annotated[StrictStr, Field(max_length=_LIMITS.max_tool_call_id_chars)]


class FunctionDefinition(BaseModel):
    """A tool's ``function``: ``parameters`` is the JSON schema of its arguments (an object's);
    ``strict`` is accepted and always honoured where calls are constrained."""

    model_config = ConfigDict(extra="forbid")

    name: FunctionName
    description: Description | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: FunctionName


class NamedToolChoice(BaseModel):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``: call exactly this function."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: NamedFunction


class CalledFunction(BaseModel):
    name: FunctionName
    arguments: Arguments


class ToolCallIn(BaseModel):
    """A call in an assistant message of the history."""

    model_config = ConfigDict(extra="forbid")

    id: CallId
    type: Literal["function"] = "function"
    function: CalledFunction


class ToolFields(BaseModel):
    """The chat request's tool fields (mixed into ``ChatCompletionRequest``)."""

    tools: Annotated[list[ToolDefinition], Field(max_length=_LIMITS.max_tools)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool = PARALLEL_TOOL_CALLS_DEFAULT


HTTP_FIELDS = ToolFieldNames(tools="tools", parameters="tools[{i}].function.parameters", choice="tool_choice",
                             named="tool_choice.function.name")
"""How this API names the tool fields."""


def tool_use_of(request: ToolFields) -> ToolUse:
    """The request's tool use, checked (``tool_use.tool_use_of``).

    Raises:
        InvalidRequestError: a bad tool or ``tool_choice``, named as this API names it.
    """
    tools = [FunctionTool(d.function.name, d.function.description or "", d.function.parameters or {})
             for d in request.tools or ()]
    choice = request.tool_choice
    if isinstance(choice, NamedToolChoice):
        return tool_use.tool_use_of(tools, ToolChoiceMode.NAMED, choice.function.name, False, HTTP_FIELDS)
    mode = None if choice is None else ToolChoiceMode(choice)
    return tool_use.tool_use_of(tools, mode, "", request.parallel_tool_calls, HTTP_FIELDS)


def history_calls(calls: Sequence[ToolCallIn] | None) -> tuple[ToolCall, ...]:
    """An assistant message's calls as the tokenizer takes them."""
    return tuple(ToolCall(call.id, call.function.name, call.function.arguments) for call in calls or ())


class ToolCallStream:
    """One choice's answer parsed for calls as it streams, in OpenAI's chunk shapes.

    Args:
        kind: the parser (``--tool-call-parser``).
    """

    def __init__(self, kind: ToolCallParserKind) -> None:
        self._parser = PARSERS[kind]()

    @property
    def cut_short(self) -> bool:
        """Whether the answer ended inside a call."""
        return self._parser.cut_short

    @property
    def called(self) -> bool:
        """Whether the answer made calls and none was cut short (``tool_use.ended_by_calls``)."""
        return self._parser.called

    def pieces(self, text: str, last: bool) -> tuple[str, list[DeltaToolCall]]:
        """The content and call pieces that ``text`` (the choice's next text; ``last``: its end)
        completes; each new call gets its id here. A call cut short at the end after its start was sent
        gets the rest of its arguments (it cannot be taken back: only the finish reason says it was cut);
        one cut inside its head was never sent, and its text is content."""
        events = self._parser.feed(text) + (self._parser.finish() if last else [])
        calls: list[DeltaToolCall] = []
        content: list[str] = []
        for event in events:
            if isinstance(event, CallCut):
                if event.index >= self._parser.calls_started:
                    content.append(event.text)
                elif event.rest:
                    calls.append(DeltaToolCall(index=event.index, function=DeltaFunction(arguments=event.rest)))
            elif isinstance(event, ContentPiece):
                content.append(event.text)
            elif isinstance(event, CallStart):
                calls.append(DeltaToolCall(index=event.index, id=new_call_id(), type="function",
                                           function=DeltaFunction(name=event.name, arguments="")))
            elif isinstance(event, ArgumentsPiece) and calls and calls[-1].index == event.index:
                calls[-1].function.arguments = (calls[-1].function.arguments or "") + event.text
            elif isinstance(event, ArgumentsPiece):
                calls.append(DeltaToolCall(index=event.index, function=DeltaFunction(arguments=event.text)))
        return "".join(content), calls


def answer_message(text: str, tool_use: ToolUse, kind: ToolCallParserKind) -> tuple[ChatMessageOut, bool]:
    """A whole answer as the chat message, with its complete calls split out when the request parses
    calls (a call cut short stays in the content as written), and whether it made calls, none cut short
    (``tool_use.ended_by_calls``)."""
    if not tool_use.parses_calls:
        return ChatMessageOut(content=text), False
    answer = parse_tool_calls(text, kind)
    if not answer.calls:
        return ChatMessageOut(content=text), False
    calls = [ToolCallOut(id=new_call_id(), function=FunctionCallOut(name=name, arguments=arguments))
             for name, arguments in answer.calls]
    return ChatMessageOut(content=answer.content, tool_calls=calls), not answer.cut_short


def finish_reason_of(reason: FinishReason | None, stop_reason: str | int | None, called: bool) -> str | None:
    """OpenAI's ``finish_reason``: ``tool_calls`` for an answer that made calls, none cut short, and ended by
    itself (``tool_use.ended_by_calls``)."""
    return "tool_calls" if ended_by_calls(reason, stop_reason, called) else finish_reason_name(reason)
