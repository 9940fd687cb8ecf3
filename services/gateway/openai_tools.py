"""Tool calls on the HTTP chat API: the request fields (``tools``, ``tool_choice``,
``parallel_tool_calls``, and tool use in the history), what they ask of the engine, and the calls
found in an answer.

``tool_choice``: ``none`` offers the tools but parses no call; ``auto`` (the default with tools)
generates freely and parses the calls afterwards; ``required`` and a named function constrain
decoding to calls (``tool_calls.calls_grammar``: every call parses and its arguments validate
against the function's schema). Calls are read by the parser ``--tool-call-parser`` names
(``tool_parsers``).
"""

from __future__ import annotations

import enum
import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr

from pagedserve.engine.messages import FinishReason
from pagedserve.engine.request_errors import InvalidRequestError
from pagedserve.engine.structured_output import StructuredOutput, StructureKind, check_structured_output
from pagedserve.text.tool_calls import MAX_TOOLS, FunctionTool, ToolCall, calls_grammar
from pagedserve.text.tool_parsers import (
    PARSERS, ArgumentsPiece, CallStart, ContentPiece, ToolCallParserKind, parse_tool_calls,
)
from services.gateway.openai_responses import (
    ChatMessageOut, DeltaFunction, DeltaToolCall, FunctionCallOut, ToolCallOut, finish_reason_name,
)

MAX_FUNCTION_NAME_CHARS = 64
"""Longest function name (OpenAI's bound)."""
FunctionName = Annotated[StrictStr, Field(min_length=1, max_length=MAX_FUNCTION_NAME_CHARS,
                                          pattern=r"^[A-Za-z0-9_.-]+$")]
Description = Annotated[StrictStr, Field(max_length=16 << 10)]
Arguments = Annotated[StrictStr, Field(max_length=1 << 20)]
CallId = Annotated[StrictStr, Field(max_length=256)]


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

    tools: Annotated[list[ToolDefinition], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool = True


class ToolChoiceMode(enum.Enum):
    """What ``tool_choice`` asks (see the module's docstring)."""

    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "named"


@dataclass(frozen=True)
class ToolUse:
    """A chat request's tools and what it asks of them.

    Attributes:
        tools: the tools offered (rendered into the prompt).
        mode: ``tool_choice``; ``NONE`` also for a request without tools.
        structure: for ``REQUIRED`` and ``NAMED``, the grammar that constrains the answer to calls.
    """

    tools: tuple[FunctionTool, ...] = ()
    mode: ToolChoiceMode = ToolChoiceMode.NONE
    structure: StructuredOutput | None = None

    @property
    def parses_calls(self) -> bool:
        """Whether answers are parsed for calls."""
        return self.mode is not ToolChoiceMode.NONE


def _tool_of(i: int, definition: ToolDefinition) -> FunctionTool:
    """The tool, its parameters schema checked as a structured output's would be.

    Raises:
        InvalidRequestError: ``tools[i].function.parameters`` naming the reason.
    """
    function = definition.function
    parameters = function.parameters or {}
    if parameters:
        try:
            check_structured_output(StructuredOutput(StructureKind.JSON, json.dumps(parameters)))
        except InvalidRequestError as e:
            raise e.renamed(f"tools[{i}].function.parameters") from None
    return FunctionTool(function.name, function.description or "", parameters)


def _mode_of(choice: Literal["none", "auto", "required"] | NamedToolChoice | None, has_tools: bool) -> ToolChoiceMode:
    if choice is None:
        return ToolChoiceMode.AUTO if has_tools else ToolChoiceMode.NONE
    return ToolChoiceMode.NAMED if isinstance(choice, NamedToolChoice) else ToolChoiceMode(choice)


def tool_use_of(request: ToolFields) -> ToolUse:
    """The request's tool use, checked.

    Raises:
        InvalidRequestError: ``tool_choice`` other than ``none`` without tools, or naming a function
            that is not among them; ``tools`` with two functions of one name, or whose calls'
            grammar is too large; ``tools[i].function.parameters`` that is not a usable JSON schema.
    """
    tools = tuple(_tool_of(i, definition) for i, definition in enumerate(request.tools or ()))
    mode = _mode_of(request.tool_choice, bool(tools))
    if not tools:
        if mode is not ToolChoiceMode.NONE:
            raise InvalidRequestError("tool_choice", "needs tools")
        return ToolUse()
    names = [tool.name for tool in tools]
    if len(set(names)) != len(names):
        raise InvalidRequestError("tools", "two functions have the same name")
    if mode is ToolChoiceMode.NAMED:
        assert isinstance(request.tool_choice, NamedToolChoice)
        name = request.tool_choice.function.name
        if name not in names:
            raise InvalidRequestError("tool_choice.function.name", f"{name!r} is not one of the tools")
        called = tuple(tool for tool in tools if tool.name == name)
        structure = StructuredOutput(StructureKind.GRAMMAR, calls_grammar(called, parallel=False))
    elif mode is ToolChoiceMode.REQUIRED:
        structure = StructuredOutput(StructureKind.GRAMMAR, calls_grammar(tools, request.parallel_tool_calls))
    else:
        return ToolUse(tools, mode)
    try:
        check_structured_output(structure)
    except InvalidRequestError as e:
        raise e.renamed("tools") from None
    return ToolUse(tools, mode, structure)


def new_call_id() -> str:
    """A tool call's id: ``call_`` and 32 random hex digits."""
    return f"call_{uuid.uuid4().hex}"


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
        self.calls = 0

    def pieces(self, text: str, last: bool) -> tuple[str, list[DeltaToolCall]]:
        """The content and call pieces that ``text`` (the choice's next text; ``last``: its end)
        completes; each new call gets its id here."""
        events = self._parser.feed(text) + (self._parser.finish() if last else [])
        calls: list[DeltaToolCall] = []
        for event in events:
            if isinstance(event, CallStart):
                self.calls += 1
                calls.append(DeltaToolCall(index=event.index, id=new_call_id(), type="function",
                                           function=DeltaFunction(name=event.name, arguments="")))
            elif isinstance(event, ArgumentsPiece) and calls and calls[-1].index == event.index:
                calls[-1].function.arguments = (calls[-1].function.arguments or "") + event.text
            elif isinstance(event, ArgumentsPiece):
                calls.append(DeltaToolCall(index=event.index, function=DeltaFunction(arguments=event.text)))
        return "".join(event.text for event in events if isinstance(event, ContentPiece)), calls


def answer_message(text: str, tool_use: ToolUse, kind: ToolCallParserKind) -> ChatMessageOut:
    """A whole answer as the chat message: with its calls split out when the request parses calls."""
    if not tool_use.parses_calls:
        return ChatMessageOut(content=text)
    answer = parse_tool_calls(text, kind)
    if not answer.calls:
        return ChatMessageOut(content=text)
    calls = [ToolCallOut(id=new_call_id(), function=FunctionCallOut(name=name, arguments=arguments))
             for name, arguments in answer.calls]
    return ChatMessageOut(content=answer.content, tool_calls=calls)


def finish_reason_of(reason: FinishReason | None, called: bool) -> str | None:
    """OpenAI's ``finish_reason``: ``tool_calls`` for an answer that made calls and ended by itself."""
    return "tool_calls" if called and reason is FinishReason.STOP else finish_reason_name(reason)
