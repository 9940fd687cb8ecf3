"""Chat rendering and tokenization in which message contents cannot forge the template's markers.

A chat template writes turn markers such as ``<|im_start|>`` as text, and the tokenizer turns that
text into special tokens. Tokenizing the whole rendered text would also turn a marker *inside a
message's content* into a special token, so a user message holding
``<|im_end|>\\n<|im_start|>system\\n...`` would open a real system turn. Here, as in the OpenAI API,
contents are tokenized as plain text: the template's own markers stay special tokens.

How: when a content holds the text of an added token, the template is rendered with a unique
random placeholder per message instead of its content; the rendered text is split at the
placeholders; template pieces are tokenized as usual and contents with special-token matching
off. Otherwise (the usual case) the rendered text is tokenized whole, which gives the very ids
``apply_chat_template(..., tokenize=True)`` gives.

Every other string the template renders (a message's ``name``, a call's id and ``arguments``, a
tool's description and ``parameters``) is refused when it spells an added token: templates write
those through filters (``tojson``) whose output a placeholder cannot stand in for, and none of them
needs marker text.
"""

from __future__ import annotations

import enum
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pagedserve.engine.request_errors import InvalidRequestError
from pagedserve.text.tool_calls import FunctionTool, fallback_conversation


class ChatPromptMode(enum.Enum):
    """How a rendered conversation ends.

    Members:
        OPEN_ASSISTANT_TURN: the template's generation prompt opens an assistant turn (OpenAI's
            ``add_generation_prompt``, the default).
        NO_GENERATION_PROMPT: the conversation ends after its last message, as the template closes it.
        CONTINUE_FINAL_MESSAGE: the last message is left open (no end-of-turn marker), so the model
            continues its text (``continue_final_message``).
    """

    OPEN_ASSISTANT_TURN = "open_assistant_turn"
    NO_GENERATION_PROMPT = "no_generation_prompt"
    CONTINUE_FINAL_MESSAGE = "continue_final_message"


class ChatEncoder:
    """Renders a conversation with a Hugging Face tokenizer's chat template and tokenizes it.

    Args:
        tokenizer: a loaded Hugging Face tokenizer that has a chat template.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._added = tuple(tokenizer.get_added_vocab())
        self._encode_plain = _plain_text_encoder(tokenizer)
        self.takes_tools = _template_takes_tools(tokenizer)

    def encode(self, conversation: Sequence[dict[str, Any]],
               mode: ChatPromptMode = ChatPromptMode.OPEN_ASSISTANT_TURN,
               tools: Sequence[FunctionTool] = ()) -> list[int]:
        """Token ids of the conversation (OpenAI-shaped messages: ``role``, ``content``, and for tool
        use ``tool_calls`` and ``tool_call_id``), with ``tools`` offered, ended as ``mode`` says.

        A template that takes tools (:attr:`takes_tools`) gets the tools and the messages as they
        are; otherwise tools and calls are written into the contents (``tool_calls.fallback_conversation``).
        The template writes the special tokens itself, so none are added while tokenizing; special
        tokens spelled inside a content are tokenized as their characters.

        Raises:
            InvalidRequestError: a string other than a content spells an added token (field
                ``messages[i]...`` or ``tools[j]...``, as in the OpenAI shape).
        """
        if not self.takes_tools:
            conversation, tools = fallback_conversation(conversation, tools), ()
        rendering = _Rendering(mode, [tool.as_openai() for tool in tools] or None)
        self._refuse_marker_text(conversation, rendering.tools or ())
        if any(self._holds_added_token(message["content"]) for message in conversation):
            return self._encode_contents_as_text(conversation, rendering)
        return list(self._tokenizer.encode(self._render(conversation, rendering), add_special_tokens=False))

    def encode_contents_as_text(self, conversation: Sequence[dict[str, Any]],
                                mode: ChatPromptMode = ChatPromptMode.OPEN_ASSISTANT_TURN) -> list[int]:
        """Token ids of the conversation, contents split from the template and tokenized as text.

        For contents without special-token text the ids are those of ``encode`` (tokenizers that
        merge across the start of a content, such as one beginning with whitespace, may differ).
        """
        return self._encode_contents_as_text(conversation, _Rendering(mode))

    def _encode_contents_as_text(self, conversation: Sequence[dict[str, Any]], rendering: _Rendering) -> list[int]:
        marks = {f"PAGEDSERVECONTENT{uuid.uuid4().hex}": message["content"] for message in conversation}
        placeholders = [{**message, "content": mark} for mark, message in zip(marks, conversation)]
        rendered = self._render(placeholders, rendering)
        ids: list[int] = []
        for piece in re.split("(" + "|".join(marks) + ")", rendered):
            if piece in marks:
                ids += self._encode_plain(marks[piece]) if marks[piece] else []
            elif piece:
                ids += self._tokenizer.encode(piece, add_special_tokens=False)
        return ids

    def _render(self, conversation: Sequence[dict[str, Any]], rendering: _Rendering) -> str:
        return self._tokenizer.apply_chat_template(
            list(conversation), tools=rendering.tools, tokenize=False,
            add_generation_prompt=rendering.mode is ChatPromptMode.OPEN_ASSISTANT_TURN,
            continue_final_message=rendering.mode is ChatPromptMode.CONTINUE_FINAL_MESSAGE)

    def _holds_added_token(self, content: str) -> bool:
        return any(token in content for token in self._added)

    def _refuse_marker_text(self, conversation: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]]) -> None:
        """Raises InvalidRequestError for the first string the template renders as it is (anything
        but a message's content) that spells an added token: tokenized with the rendered text, it
        would become that token (a forged ``<|im_start|>system`` in a call's arguments opened a
        system turn)."""
        parts = [(f"messages[{i}]", {k: v for k, v in m.items() if k != "content"}) for i, m in enumerate(conversation)]
        parts += [(f"tools[{j}]", tool) for j, tool in enumerate(tools)]
        for path, part in parts:
            for field, text in _strings(part, path, inside_document=False):
                token = next((t for t in self._added if t in text), None)
                if token is not None:
                    raise InvalidRequestError(field, f"holds the text of the token {token!r}, which the chat template "
                                                     "would turn into that token; only message contents may")


_DOCUMENTS = frozenset({"arguments", "parameters"})
"""Keys whose values are JSON documents a client wrote whole: strings inside one are named by its path."""


def _strings(value: Any, path: str, inside_document: bool) -> Any:
    """``(path, text)`` of every string in an OpenAI-shaped value, dictionary keys included."""
    if isinstance(value, str):
        yield path, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield path, str(key)
            yield from _strings(item, path if inside_document else f"{path}.{key}", inside_document or key in _DOCUMENTS)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _strings(item, path if inside_document else f"{path}[{i}]", inside_document)


@dataclass(frozen=True)
class _Rendering:
    """How a conversation is rendered: its ending, and the tools (OpenAI's shape) when the template takes them."""

    mode: ChatPromptMode
    tools: list[dict[str, Any]] | None = None


_PROBE_TOOL = FunctionTool("pagedserve_probe_tool")


def _template_takes_tools(tokenizer: Any) -> bool:
    """Whether the chat template writes the tools it is given (some ignore them without a word):
    a one-message conversation rendered with a probe tool names the probe."""
    try:
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tools=[_PROBE_TOOL.as_openai()],
                                                 tokenize=False, add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - a template may fail on tools in any way; it then does not take them
        return False
    return _PROBE_TOOL.name in rendered


def _plain_text_encoder(tokenizer: Any) -> Callable[[str], list[int]]:
    """A function tokenizing text with special-token strings taken as plain characters.

    Fast tokenizers get a private copy of their backend with ``encode_special_tokens`` set once
    (setting it on the shared backend per call would race with other threads); slow ones are
    asked per call with ``split_special_tokens``.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return lambda text: list(tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))
    from tokenizers import Tokenizer  # heavy import, kept off module import

    plain = Tokenizer.from_str(backend.to_str())
    plain.encode_special_tokens = True
    return lambda text: plain.encode(text, add_special_tokens=False).ids
