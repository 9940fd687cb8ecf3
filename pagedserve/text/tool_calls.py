"""Tools (functions a chat model may call) and their calls, in the Hermes/Qwen form.

The form: a call is ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` in the
assistant's text, several calls follow each other separated by a newline, and a tool's result
comes back in a ``tool`` message. Qwen2.5's and Hermes 2/3's chat templates write it; for a model
whose template does not take tools, :func:`fallback_conversation` writes the same form into the
conversation itself (a system prompt listing the tools, the calls and results of the history as
text), so the model sees one form whichever template it has. The ``hermes`` tool-call parser
(``tool_parsers``) reads it back, and :func:`calls_grammar` constrains decoding to it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
CALL_SEPARATOR = "\n"
"""What comes between two calls of one answer (and after ``<tool_call>``, before ``</tool_call>``)."""
MAX_TOOLS = 128
"""Most tools in one request."""

FALLBACK_PROMPT = (
    "You may call one or more functions to help with the user's request. The functions you may call "
    "are given as JSON schemas within <tools></tools> tags:\n<tools>\n{tools}\n</tools>\n"
    "To call a function, write a JSON object with the function's name and arguments within "
    "<tool_call></tool_call> tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n"
    "</tool_call>\nA function's result comes back within <tool_response></tool_response> tags.")
"""The system prompt describing the tools to a model whose chat template does not take them
(Hermes' own wording, shortened); ``{tools}`` is one tool's JSON per line."""


@dataclass(frozen=True)
class FunctionTool:
    """A function the model may call.

    Attributes:
        name: the function's name (what a call names).
        description: what it does, for the model ("" for none).
        parameters: the JSON schema of its arguments (an object schema; ``{}`` takes any object).
    """

    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=dict)

    def as_openai(self) -> dict[str, Any]:
        """The tool as OpenAI's API and chat templates spell it (``{"type": "function", "function": ...}``)."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters or {"type": "object"}}}


@dataclass(frozen=True)
class ToolCall:
    """One call the model made.

    Attributes:
        id: the call's id (``call_<random>``), which the tool's result message quotes.
        name: the function called.
        arguments: the arguments as JSON text, as the model wrote them.
    """

    id: str
    name: str
    arguments: str

    def as_openai(self) -> dict[str, Any]:
        """The call as chat templates read it: OpenAI's shape with the arguments parsed (templates
        write them with ``tojson``); arguments that are not JSON stay text."""
        try:
            arguments: Any = json.loads(self.arguments)
        except (json.JSONDecodeError, RecursionError):  # nested too deeply for the parser: text too
            arguments = self.arguments
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": arguments}}



def call_text(call: dict[str, Any]) -> str:
    """A call in OpenAI's shape (``ToolCall.as_openai``) in the Hermes form, as the model would write it."""
    function = call["function"]
    arguments = function["arguments"]
    arguments = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return (f"{TOOL_CALL_OPEN}{CALL_SEPARATOR}{{\"name\": {json.dumps(function['name'])}, \"arguments\": "
            f"{arguments}}}{CALL_SEPARATOR}{TOOL_CALL_CLOSE}")


def fallback_conversation(conversation: Sequence[dict[str, Any]], tools: Sequence[FunctionTool]
                          ) -> list[dict[str, str]]:
    """The conversation (OpenAI-shaped messages: ``role``, ``content``, and ``tool_calls`` as
    ``ToolCall.as_openai`` makes them) with the tools and calls written as text, for a template
    that takes neither.

    The tools' prompt (:data:`FALLBACK_PROMPT`) opens the system message (one is added first when
    there is none); an assistant message's ``tool_calls`` follow its content in the Hermes form; the
    content of a message answering a call (``tool_call_id``) is wrapped in ``<tool_response>`` tags. Each message keeps only
    ``role``, ``content`` and its ``name``, so every other text the client sent stays a content.
    """
    turns = []
    for message in conversation:
        content = message["content"]
        calls = message.get("tool_calls", ())
        if calls:
            content = CALL_SEPARATOR.join(([content] if content else []) + [call_text(call) for call in calls])
        if message.get("tool_call_id") is not None:
            content = f"<tool_response>\n{content}\n</tool_response>"
        name = {"name": message["name"]} if "name" in message else {}
        turns.append({"role": message["role"], "content": content, **name})
    if tools:
        prompt = FALLBACK_PROMPT.format(tools="\n".join(json.dumps(t.as_openai()) for t in tools))
        if turns and turns[0]["role"] == "system":
            turns[0] = {**turns[0], "content": prompt + "\n\n" + turns[0]["content"]}
        else:
            turns.insert(0, {"role": "system", "content": prompt})
    return turns


def _call_schema(tool: FunctionTool) -> dict[str, Any]:
    """The JSON schema of one call of ``tool``: ``{"name": <its name>, "arguments": <its parameters>}``,
    compact (llguidance's ``x-guidance`` options); the parameters' ``$defs`` move to the root, where
    their ``#/$defs/...`` references point."""
    parameters = dict(tool.parameters or {"type": "object"})
    defs = parameters.pop("$defs", None)
    schema: dict[str, Any] = {
        "type": "object", "properties": {"name": {"const": tool.name}, "arguments": parameters},
        "required": ["name", "arguments"], "additionalProperties": False,
        "x-guidance": {"whitespace_flexible": False}}
    if defs is not None:
        schema["$defs"] = defs
    return schema


def calls_grammar(tools: Sequence[FunctionTool], parallel: bool) -> str:
    """A Lark grammar (llguidance's dialect, ``%json`` for the JSON parts) of an answer made only of
    calls of ``tools``: one call, or with ``parallel`` one or more separated by newlines. Each call
    names one of the tools and its arguments match that tool's parameters schema.

    Raises:
        ValueError: no tools.
    """
    if not tools:
        raise ValueError("calls_grammar needs at least one tool")
    lines = ["start: call (\"\\n\" call)*" if parallel else "start: call",
             f"call: {json.dumps(TOOL_CALL_OPEN + CALL_SEPARATOR)} body {json.dumps(CALL_SEPARATOR + TOOL_CALL_CLOSE)}",
             "body: " + " | ".join(f"tool_{i}" for i in range(len(tools)))]
    lines += [f"tool_{i}: %json {json.dumps(_call_schema(tool))}" for i, tool in enumerate(tools)]
    return "\n".join(lines) + "\n"
