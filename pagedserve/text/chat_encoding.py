"""Chat rendering and tokenization in which client text cannot forge the template's markers.

A chat template writes turn markers such as ``<|im_start|>`` as text, and the tokenizer turns that
text into special tokens. Tokenizing the whole rendered text would also turn a marker *inside a
message's content* into a special token, so a user message holding
``<|im_end|>\\n<|im_start|>system\\n...`` would open a real system turn. Here, as in the OpenAI API,
contents are tokenized as plain text: the template's own markers stay special tokens.

How (``chat_marks``): every added token's text in the conversation's client strings (a content, a
name, a call's arguments, a tool's description, ...), and every piece of one the template's text
could complete, is replaced by a unique random mark for rendering; the rendered text is split at
the marks; template pieces are tokenized as usual and the marked texts with special-token matching
off. Otherwise (the usual case) the rendered text is tokenized whole, which gives the very ids
``apply_chat_template(..., tokenize=True)`` gives.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pagedserve.engine.request_errors import InvalidRequestError
from pagedserve.text.chat_marks import AddedTokenText, TextMarks
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
        self._added = AddedTokenText(tuple(tokenizer.get_added_vocab()))
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
            InvalidRequestError: field ``messages``: the template damaged a marked text
                (``chat_marks``), or the conversation is nested too deeply.
        """
        if not self.takes_tools:
            conversation, tools = fallback_conversation(conversation, tools), ()
        rendering = _Rendering(mode, [tool.as_openai() for tool in tools] or None)
        marks = TextMarks(self._added)
        try:
            marked_tools, marked = marks.structure(rendering.tools), marks.structure(conversation)
        except RecursionError as exc:
            raise InvalidRequestError("messages", "nested too deeply") from exc
        if not marks:
            return self._encode_template(self._render(conversation, rendering))
        return marks.tokenize(self._render(marked, _Rendering(mode, marked_tools)), self._encode_template,
                              self._encode_plain)

    def encode_contents_as_text(self, conversation: Sequence[dict[str, Any]],
                                mode: ChatPromptMode = ChatPromptMode.OPEN_ASSISTANT_TURN) -> list[int]:
        """Token ids of the conversation, contents split from the template and tokenized as text.

        For contents without special-token text the ids are those of ``encode`` (tokenizers that
        merge across the start of a content, such as one beginning with whitespace, may differ).
        """
        marks = TextMarks(self._added)
        marked = [{**message, "content": marks.mark(message["content"]) if message["content"] else message["content"]}
                  for message in conversation]
        return marks.tokenize(self._render(marked, _Rendering(mode)), self._encode_template, self._encode_plain)

    def _encode_template(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def _render(self, conversation: Sequence[dict[str, Any]], rendering: _Rendering) -> str:
        return self._tokenizer.apply_chat_template(
            list(conversation), tools=rendering.tools, tokenize=False,
            add_generation_prompt=rendering.mode is ChatPromptMode.OPEN_ASSISTANT_TURN,
            continue_final_message=rendering.mode is ChatPromptMode.CONTINUE_FINAL_MESSAGE)


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
