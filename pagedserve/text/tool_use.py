"""What a chat request's tools ask of the engine, and the calls found in its answers, for every API.

The HTTP API (``pagedserve/services/gateway/openai_tools``) and the gRPC API
(``pagedserve/services/gateway/request_parser``, ``grpc_tools``) read their own request shapes, then call
:func:`tool_use_of`, which checks the tools and maps ``tool_choice`` to what decoding must do: ``none`` offers the tools but parses no call;
``auto`` (the default with tools) generates freely and parses the calls afterwards; ``required``
and a named function constrain decoding to calls (``tool_calls.calls_grammar``: every call parses
and its arguments validate against the function's schema). Calls are read by the parser
``--tool-call-parser`` names (``tool_parsers``).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from pagedserve.engine.messages import FinishReason
from pagedserve.engine.request_errors import InvalidRequestError
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.engine.structured_output import StructuredOutput, StructureKind, check_structured_output
from pagedserve.text.tool_calls import FunctionTool, ToolCall, calls_grammar
from pagedserve.text.tool_parsers import (
    PARSERS, ArgumentsPiece, CallCut, CallEnd, CallStart, ContentPiece, ToolCallParserKind,
)

FUNCTION_NAME_PATTERN = r"^[A-Za-z0-9_.-]+$"
"""The characters a function name may hold (OpenAI's rule; its length bound is
``RequestLimits.max_function_name_chars``)."""
PARALLEL_TOOL_CALLS_DEFAULT = True
"""``parallel_tool_calls`` when a request does not say (OpenAI's default)."""


class ToolChoiceMode(enum.Enum):
    """What ``tool_choice`` asks (see the module's docstring)."""

    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "named"


@dataclass(frozen=True)
class ToolFieldNames:
    """How an API names the tool fields in its errors.

    Attributes:
        tools: the list of tools.
        parameters: one tool's parameters schema, with ``{i}`` for the tool's index.
        choice: ``tool_choice``.
        named: the function name of a named ``tool_choice``.
    """

    tools: str
    parameters: str
    choice: str
    named: str


@dataclass(frozen=True)
class ToolUse:
    """A chat request's tools and what it asks of them.

    Attributes:
        tools: the tools offered (rendered into the prompt).
        mode: ``tool_choice``; ``NONE`` also for a request without tools.
        structure: for ``REQUIRED`` and ``NAMED``, the grammar that constrains the answer to calls.
        choice_field: the name of ``tool_choice`` in the request's API (for errors).
    """

    tools: tuple[FunctionTool, ...] = ()
    mode: ToolChoiceMode = ToolChoiceMode.NONE
    structure: StructuredOutput | None = None
    choice_field: str = "tool_choice"

    @property
    def parses_calls(self) -> bool:
        """Whether answers are parsed for calls."""
        return self.mode is not ToolChoiceMode.NONE

    def constrain(self, params: SamplingParams) -> SamplingParams:
        """``params`` with the calls' grammar as their structured output (unchanged when the
        choice constrains nothing).

        Raises:
            InvalidRequestError: ``tool_choice`` (as ``choice_field``) when ``params`` already ask
                for a structured output.
        """
        if self.structure is None:
            return params
        if params.structured_output is not None:
            raise InvalidRequestError(self.choice_field, f"{self.mode.value} constrains the answer to tool calls, "
                                      "so it cannot go with a structured output")
        return dataclasses.replace(params, structured_output=self.structure)


def _checked_tool(tool: FunctionTool, field: str) -> FunctionTool:
    """``tool``, its parameters schema checked as a structured output's would be.

    Raises:
        InvalidRequestError: ``field`` naming the reason.
    """
    if tool.parameters.get("type", "object") != "object":  # as OpenAI: the call's arguments are an object
        raise InvalidRequestError(field, f"must be the schema of a JSON object (type \"object\"), not of type "
                                         f"{json.dumps(tool.parameters['type'])[:100]}")
    if tool.parameters:
        try:
            check_structured_output(StructuredOutput(StructureKind.JSON, json.dumps(tool.parameters)))
        except InvalidRequestError as e:
            raise e.renamed(field) from None
    return tool


def tool_use_of(tools: Sequence[FunctionTool], mode: ToolChoiceMode | None, named: str, parallel: bool,
                names: ToolFieldNames) -> ToolUse:
    """The request's tool use, checked.

    Args:
        tools: the tools offered (names and sizes already checked by the API's own parsing).
        mode: the ``tool_choice`` asked; None: not given (``AUTO`` with tools, else ``NONE``).
        named: for ``NAMED``, the function to call.
        parallel: ``parallel_tool_calls`` (``REQUIRED`` may then make several calls).
        names: the API's field names, for errors.

    Raises:
        InvalidRequestError: ``tool_choice`` other than ``none`` without tools, or naming a function
            that is not among them; ``tools`` with two functions of one name, or whose calls'
            grammar is too large; a tool's parameters that are not a usable JSON schema.
    """
    tools = tuple(_checked_tool(tool, names.parameters.format(i=i)) for i, tool in enumerate(tools))
    if mode is None:
        mode = ToolChoiceMode.AUTO if tools else ToolChoiceMode.NONE
    if not tools:
        if mode is not ToolChoiceMode.NONE:
            raise InvalidRequestError(names.choice, "needs tools")
        return ToolUse(choice_field=names.choice)
    tool_names = [tool.name for tool in tools]
    if len(set(tool_names)) != len(tool_names):
        raise InvalidRequestError(names.tools, "two functions have the same name")
    if mode is ToolChoiceMode.NAMED:
        if named not in tool_names:
            raise InvalidRequestError(names.named, f"{named!r} is not one of the tools")
        called = tuple(tool for tool in tools if tool.name == named)
        structure = StructuredOutput(StructureKind.GRAMMAR, calls_grammar(called, parallel=False))
    elif mode is ToolChoiceMode.REQUIRED:
        structure = StructuredOutput(StructureKind.GRAMMAR, calls_grammar(tools, parallel))
    else:
        return ToolUse(tools, mode, choice_field=names.choice)
    try:
        check_structured_output(structure)
    except InvalidRequestError as e:
        raise e.renamed(names.tools) from None
    return ToolUse(tools, mode, structure, names.choice)


def new_call_id() -> str:
    """A tool call's id: ``call_`` and 32 random hex digits."""
    return f"call_{uuid.uuid4().hex}"


def ended_by_calls(reason: FinishReason | None, stop_reason: str | int | None, called: bool) -> bool:
    """Whether a sample is reported as ending for its tool calls: it made calls, none cut short (the
    streams' and parsed answers' ``called``), and ended by itself: ``STOP`` at an EOS or a stop token id.
    One a stop string cut (``stop_reason`` a string: the client's cut, wherever it fell, whether or not
    its text is in the output), one cut by ``LENGTH`` or aborted keeps that reason."""
    return called and reason is FinishReason.STOP and not isinstance(stop_reason, str)


class WholeCallStream:
    """One sample's answer parsed for calls as it streams, each call given whole once it ends.

    Args:
        kind: the parser (``--tool-call-parser``).
    """

    def __init__(self, kind: ToolCallParserKind) -> None:
        self._parser = PARSERS[kind]()
        self._name = ""
        self._arguments: list[str] = []

    @property
    def cut_short(self) -> bool:
        """Whether the answer ended inside a call (its text came as content, not as a call)."""
        return self._parser.cut_short

    @property
    def called(self) -> bool:
        """Whether the answer made calls and none was cut short (see :func:`ended_by_calls`)."""
        return self._parser.called

    def pieces(self, text: str, last: bool) -> tuple[str, list[ToolCall]]:
        """The content and the whole calls that ``text`` (the sample's next text; ``last``: its
        end) completes; each call gets its id here. A call's text never shows in the content, but for a
        call cut short at the end: only its text, never a call whose arguments may not parse."""
        events = self._parser.feed(text) + (self._parser.finish() if last else [])
        calls: list[ToolCall] = []
        content: list[str] = []
        for event in events:
            if isinstance(event, CallStart):
                self._name, self._arguments = event.name, []
            elif isinstance(event, ArgumentsPiece):
                self._arguments.append(event.text)
            elif isinstance(event, CallEnd):
                calls.append(ToolCall(new_call_id(), self._name, "".join(self._arguments)))
            content.append(event.text if isinstance(event, ContentPiece | CallCut) else "")
        return "".join(content), calls
