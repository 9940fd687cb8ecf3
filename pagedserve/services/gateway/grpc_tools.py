"""Tool calls on the gRPC API: ``ChatMessages``' tools, ``tool_choice`` and ``parallel_tool_calls``,
tool use in the history (``ChatMessage.tool_calls``, ``tool_call_id``), and the calls found in each
sample's answer (``GenerateResponse.tool_calls``, ``FINISH_REASON_TOOL_CALLS``).

What the fields ask of the engine is ``pagedserve.text.tool_use``'s, shared with the HTTP API.
"""

from __future__ import annotations

import json
import re

from pagedserve.engine.messages import FinishReason
from pagedserve.engine.request_errors import InvalidRequestError
from pagedserve.engine.structured_output import MAX_SPEC_BYTES
from pagedserve.text.request_limits import RequestLimits, check_count, check_text_bytes
from pagedserve.text.tokenizer import ChatTurn
from pagedserve.text.tool_calls import FunctionTool, ToolCall
from pagedserve.text.tool_parsers import ToolCallParserKind
from pagedserve.text.tool_use import (
    FUNCTION_NAME_PATTERN, PARALLEL_TOOL_CALLS_DEFAULT, ToolChoiceMode, ToolFieldNames, ToolUse, WholeCallStream,
    ended_by_calls, tool_use_of,
)
from pagedserve.services.common.pb import generate_pb2 as gen
from pagedserve.services.common.pb_fields import enum_from_pb, enum_to_pb

GRPC_FIELDS = ToolFieldNames(tools="chat.tools", parameters="chat.tools[{i}].parameters", choice="chat.tool_choice",
                             named="chat.tool_choice.function")
"""How this API names the tool fields."""


def check_tool_sizes(chat: gen.ChatMessages, limits: RequestLimits) -> None:
    """Checks the sizes of the tools and of the history's calls (cheap, done before any parsing).

    Raises:
        InvalidRequestError: ``chat.tools``, a tool's ``description`` or ``parameters``, a message's
            ``tool_calls``, ``tool_call_id``, or a call's ``id`` or ``arguments`` beyond its bound.
    """
    check_count("chat.tools", len(chat.tools), limits.max_tools, "tools")
    for i, tool in enumerate(chat.tools):
        check_count(f"chat.tools[{i}].description", len(tool.description), limits.max_tool_description_chars,
                    "characters")
        check_text_bytes(f"chat.tools[{i}].parameters", tool.parameters, MAX_SPEC_BYTES)
    for i, message in enumerate(chat.messages[:limits.max_chat_messages]):
        field = f"chat.messages[{i}]"
        check_count(f"{field}.tool_call_id", len(message.tool_call_id), limits.max_tool_call_id_chars, "characters")
        check_count(f"{field}.tool_calls", len(message.tool_calls), limits.max_chat_messages, "calls")
        for j, call in enumerate(message.tool_calls):
            check_count(f"{field}.tool_calls[{j}].id", len(call.id), limits.max_tool_call_id_chars, "characters")
            check_count(f"{field}.tool_calls[{j}].arguments", len(call.arguments), limits.max_tool_arguments_chars,
                        "characters")


def _check_name(field: str, name: str, limits: RequestLimits) -> str:
    """``name``, a valid function name.

    Raises:
        InvalidRequestError: ``field``: empty, too long, or a character outside [A-Za-z0-9_.-].
    """
    check_count(field, len(name), limits.max_function_name_chars, "characters")
    if re.fullmatch(FUNCTION_NAME_PATTERN, name) is None:
        raise InvalidRequestError(field, f"{name!r} is not a function name: use 1 to {limits.max_function_name_chars} "
                                  "of the characters A-Z a-z 0-9 _ . -")
    return name


def _tool_of(i: int, tool: gen.Tool, limits: RequestLimits) -> FunctionTool:
    """The tool, its name checked and its parameters read (the schema itself is checked by
    ``tool_use_of``).

    Raises:
        InvalidRequestError: ``chat.tools[i].name``, or ``chat.tools[i].parameters`` that is not a
            JSON object.
    """
    name = _check_name(f"chat.tools[{i}].name", tool.name, limits)
    if not tool.parameters:
        return FunctionTool(name, tool.description)
    try:
        parameters = json.loads(tool.parameters)
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(f"chat.tools[{i}].parameters", f"is not JSON ({exc}); send a JSON schema") from None
    if not isinstance(parameters, dict):
        raise InvalidRequestError(f"chat.tools[{i}].parameters", "must be a JSON schema object")
    return FunctionTool(name, tool.description, parameters)


def _mode_of(choice: gen.ToolChoice) -> ToolChoiceMode | None:
    """The mode a ``tool_choice`` of kind ``mode`` asks (None: unspecified).

    Raises:
        InvalidRequestError: ``chat.tool_choice.mode`` of a number this API does not know.
    """
    if choice.mode not in gen.ToolChoice.Mode.values():
        raise InvalidRequestError("chat.tool_choice.mode", f"{choice.mode} is not a ToolChoice.Mode")
    return enum_from_pb(choice.mode, gen.ToolChoice.Mode.DESCRIPTOR, ToolChoiceMode)


def chat_tool_use(chat: gen.ChatMessages, limits: RequestLimits) -> ToolUse:
    """The chat request's tool use, checked (sizes first: ``check_tool_sizes``).

    Raises:
        InvalidRequestError: a field under ``chat`` that is out of bounds or invalid (see
            ``check_tool_sizes``, ``tool_use.tool_use_of``), named as this API names it.
    """
    check_tool_sizes(chat, limits)
    tools = [_tool_of(i, tool, limits) for i, tool in enumerate(chat.tools)]
    parallel = chat.parallel_tool_calls if chat.HasField("parallel_tool_calls") else PARALLEL_TOOL_CALLS_DEFAULT
    kind = chat.tool_choice.WhichOneof("choice") if chat.HasField("tool_choice") else None
    if kind == "function":
        return tool_use_of(tools, ToolChoiceMode.NAMED, chat.tool_choice.function, False, GRPC_FIELDS)
    mode = _mode_of(chat.tool_choice) if kind == "mode" else None
    return tool_use_of(tools, mode, "", parallel, GRPC_FIELDS)


def chat_turns(chat: gen.ChatMessages, limits: RequestLimits) -> list[ChatTurn]:
    """The messages as the tokenizer takes them, their tool use checked.

    Raises:
        InvalidRequestError: ``chat.messages[i].tool_calls`` on a role other than assistant, or
            naming an invalid function; ``chat.messages[i].tool_call_id`` missing on a tool message
            or set on another role.
    """
    turns = []
    for i, message in enumerate(chat.messages):
        field = f"chat.messages[{i}]"
        turn = ChatTurn(message.role, message.content, tuple(ToolCall(call.id, call.name, call.arguments)
                                                             for call in message.tool_calls), message.tool_call_id or None,
                        message.name or None)
        turn.check_tool_use(field)
        for j, call in enumerate(message.tool_calls):
            _check_name(f"{field}.tool_calls[{j}].name", call.name, limits)
        turns.append(turn)
    return turns


class SampleCalls:
    """The calls of a request's samples as they stream (``GenerateResponse.tool_calls``).

    Args:
        tool_use: the request's tool use; no calls are parsed when its mode is ``NONE``.
        parser: the gateway's ``--tool-call-parser``.
    """

    def __init__(self, tool_use: ToolUse, parser: ToolCallParserKind) -> None:
        self._parses = tool_use.parses_calls
        self._parser = parser
        self._streams: dict[int, WholeCallStream] = {}

    def fill(self, response: gen.GenerateResponse, finish_reason: FinishReason | None) -> None:
        """Moves the calls out of ``response.text`` (sample ``response.index``'s next text) into
        ``response.tool_calls``, and sets ``response.finish_reason`` from ``finish_reason`` (None:
        the sample goes on; ``response``'s stop reason already set): ``TOOL_CALLS`` for a sample that made
        calls, none cut short, and ended by itself (``tool_use.ended_by_calls``)."""
        called = False
        if self._parses:
            stream = self._streams.setdefault(response.index, WholeCallStream(self._parser))
            text, calls = stream.pieces(response.text, finish_reason is not None)
            response.text = text
            response.tool_calls.extend(gen.ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in calls)
            called = stream.called
        if finish_reason is None:
            return
        stop_string = response.stop_string if response.HasField("stop_string") else None
        if ended_by_calls(finish_reason, stop_string, called):
            response.finish_reason = gen.FinishReason.FINISH_REASON_TOOL_CALLS
        else:
            response.finish_reason = enum_to_pb(finish_reason, gen.FinishReason.DESCRIPTOR)
