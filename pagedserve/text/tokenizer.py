"""Prompt tokenization and validation with the model's own Hugging Face tokenizer.

Every validation error is an ``InvalidRequestError`` whose field name is spelled as the client API
(``proto/generate.proto``) spells it, so the gateway can answer ``INVALID_ARGUMENT`` with it as is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2

from pagedserve.engine.model_info import ModelInfo
from pagedserve.engine.sampling_params import InvalidRequestError
from pagedserve.text.chat_encoding import ChatEncoder, ChatPromptMode
from pagedserve.text.request_limits import RequestLimits, check_count, check_text_bytes
from pagedserve.text.token_text import TokenBytes, text_offsets
from pagedserve.text.tokenizer_loading import file_stamps, load_prompt_tokenizer
from pagedserve.text.tool_calls import FunctionTool, ToolCall

TOOL_CALL_TEXT_BYTES = 64
"""What a chat template writes around each call in the history beside its id, name and arguments (tags, keys,
punctuation: ~50 bytes for SmolLM2's and Qwen's), counted toward the chat's byte bound: a call counted by its
arguments alone (``{}``: 2 bytes, ~24 tokens rendered) let 64 messages x 1,024 calls past it, 1.57 million
tokens and 13.5 s of gateway CPU before the 400."""

CHAT_ROLES = ("system", "user", "assistant", "tool")

# Field names of the three prompt inputs, as generate.proto names them.
PROMPT_FIELD = "prompt"
CHAT_FIELD = "chat"
TOKEN_IDS_FIELD = "prompt_token_ids.ids"


@dataclass(frozen=True)
class ChatTurn:
    """One chat message.

    Attributes:
        role: one of ``CHAT_ROLES``.
        content: the message text (may be empty).
        tool_calls: an assistant message's calls of tools (history of tool use).
        tool_call_id: a ``tool`` message's answer to the call of this id; None for other roles.
        name: the author's name (OpenAI's ``name``), for chat templates that render one; None: none.
    """

    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None

    def as_openai(self) -> dict[str, object]:
        """The message as chat templates read it (OpenAI's shape; only the keys that are set)."""
        message: dict[str, object] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [call.as_openai() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            message["name"] = self.name
        return message

    def check_tool_use(self, field: str) -> None:
        """Checks the turn's part in tool use (both APIs' rule; ``field`` names the message).

        Raises:
            InvalidRequestError: ``field.tool_calls`` on a role other than assistant;
                ``field.tool_call_id`` missing on a tool message or set on another role.
        """
        if self.tool_calls and self.role != "assistant":
            raise InvalidRequestError(f"{field}.tool_calls", f"only an assistant message makes calls, not {self.role!r}")
        if self.role == "tool" and not self.tool_call_id:
            raise InvalidRequestError(f"{field}.tool_call_id", "a tool message must give the id of the call it answers")
        if self.tool_call_id and self.role != "tool":
            raise InvalidRequestError(f"{field}.tool_call_id", f"only a tool message answers a call, not {self.role!r}")


def _rust_decoder(tokenizer: Any) -> Any | None:
    """The Rust ``tokenizers.Tokenizer`` behind a fast Hugging Face tokenizer whose ``decode`` is that
    tokenizer's plus nothing (``clean_up_tokenization_spaces`` off); ``None`` for other tokenizers."""
    if not getattr(tokenizer, "is_fast", False) or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None
    return getattr(tokenizer, "backend_tokenizer", None)


def check_prompt_length(num_tokens: int, max_model_len: int, field: str) -> None:
    """Checks that a prompt leaves room for at least one generated token.

    Args:
        num_tokens: prompt length in tokens.
        max_model_len: the model's context length in tokens.
        field: the prompt field the client used (``PROMPT_FIELD``, ``CHAT_FIELD``, ``TOKEN_IDS_FIELD``).

    Raises:
        InvalidRequestError: ``num_tokens >= max_model_len``; the message gives both numbers.
    """
    if num_tokens >= max_model_len:
        raise InvalidRequestError(
            field,
            f"the prompt has {num_tokens} tokens but the model's context is {max_model_len} tokens "
            "(the prompt must be shorter, to leave room for at least one generated token)",
        )


class PromptTokenizer:
    """Turns the three kinds of prompt input into validated token ids.

    Also satisfies the ``TokenDecoder`` protocol of ``pagedserve.text.detokenizer`` (``decode``),
    so it can be handed to the detokenizer and to ``RequestTextState`` directly.

    Args:
        tokenizer: a loaded Hugging Face tokenizer of the model.
        info: the model's facts; ``info.vocab_size`` (the config's, which may exceed
            ``len(tokenizer)``) bounds valid token ids.
        limits: size bounds checked before tokenizing (prompt bytes, chat messages and roles).
    """

    def __init__(self, tokenizer: Any, info: ModelInfo, limits: RequestLimits = RequestLimits()) -> None:
        self._tokenizer = tokenizer
        self._info = info
        self._limits = limits
        self._chat = ChatEncoder(tokenizer) if self.has_chat_template else None
        self._rust_decoder = _rust_decoder(tokenizer)

    @classmethod
    def from_folder(cls, path: str | Path, limits: RequestLimits = RequestLimits()) -> PromptTokenizer:
        """Loads the tokenizer and model facts from a local Hugging Face model folder (no hub access).

        Once per process for a folder whose small files (JSON, Jinja, text) are unchanged: the
        tokenizer is read-only once built, and loading it takes ~0.3 CPU-s (an offline engine built
        again in the same process, as the test suite does some hundred times, reuses it).

        Raises:
            pagedserve.engine.models.config.ModelConfigError: no usable ``config.json``.
            OSError: the folder has no tokenizer files.
        """
        folder = Path(path).resolve()
        return load_prompt_tokenizer(cls, folder, limits, file_stamps(folder))

    @property
    def hf_tokenizer(self) -> Any:
        """The wrapped Hugging Face tokenizer."""
        return self._tokenizer

    @property
    def info(self) -> ModelInfo:
        """The model's facts (vocab size, EOS ids, context length)."""
        return self._info

    @property
    def limits(self) -> RequestLimits:
        """The size bounds this tokenizer checks."""
        return self._limits

    @property
    def max_prompt_bytes(self) -> int:
        """Most UTF-8 bytes of a text prompt, or of a chat's contents together."""
        return self._limits.max_prompt_bytes(self._info.max_model_len)

    @property
    def has_chat_template(self) -> bool:
        """Whether the model ships a chat template."""
        return bool(getattr(self._tokenizer, "chat_template", None))

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool, spaces_between_special_tokens: bool = True) -> str:
        """Decodes ids to text exactly as the Hugging Face tokenizer does
        (``spaces_between_special_tokens`` matters to slow tokenizers only; fast ones ignore it).
        A fast tokenizer that cleans up no spaces decodes in its Rust tokenizer directly: the same
        text without the Python wrapper's per-id conversions (half the time of a detokenizer step)."""
        if self._rust_decoder is not None:
            return self._rust_decoder.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens,
                                      spaces_between_special_tokens=spaces_between_special_tokens)

    def token_bytes(self, token_id: int, decoded: str) -> bytes:
        """The UTF-8 bytes ``token_id`` adds to a text (``decoded``: its string alone), its own
        also when it is only part of a character (``token_text.TokenBytes``)."""
        return self._token_bytes(token_id, decoded)

    @cached_property
    def _token_bytes(self) -> TokenBytes:
        return TokenBytes(self._tokenizer)

    def text_offsets(self, text: str, token_ids: Sequence[int]) -> list[int]:
        """The character offset in ``text`` of each of ``token_ids`` (``text`` as ``encode_prompt``
        or ``encode_prompt_without_special_tokens`` encoded it; an added BOS stands at 0).

        Raises:
            token_text.MisalignedText: ``token_ids`` is not such an encoding of ``text``.
        """
        return text_offsets(self._tokenizer, text, token_ids)

    def encode_prompt(self, text: str) -> list[int]:
        """Tokenizes a text prompt, adding special tokens (e.g. BOS) as the tokenizer does by default.

        Raises:
            InvalidRequestError: field ``prompt``, when the text is empty, larger than
                ``max_prompt_bytes`` (checked before tokenizing) or encodes to no tokens.
        """
        return self._checked_prompt_ids(text, lambda: self._tokenizer.encode(text))

    def encode_prompt_without_special_tokens(self, text: str) -> list[int]:
        """Tokenizes a text prompt adding no special tokens (no BOS: vLLM's ``add_special_tokens: false``).

        Raises:
            InvalidRequestError: as ``encode_prompt``.
        """
        return self._checked_prompt_ids(text, lambda: self._tokenizer.encode(text, add_special_tokens=False))

    def _checked_prompt_ids(self, text: str, encode: Callable[[], Sequence[int]]) -> list[int]:
        """``encode()``'s ids, after ``text``'s checks (see ``encode_prompt``)."""
        if not text:
            raise InvalidRequestError(PROMPT_FIELD, "must not be empty")
        check_text_bytes(PROMPT_FIELD, text, self.max_prompt_bytes)
        ids = list(encode())
        if not ids:
            raise InvalidRequestError(PROMPT_FIELD, "encodes to no tokens")
        return ids

    def encode_chat(self, messages: Sequence[ChatTurn],
                    mode: ChatPromptMode = ChatPromptMode.OPEN_ASSISTANT_TURN,
                    tools: Sequence[FunctionTool] = ()) -> list[int]:
        """Renders chat messages with the model's chat template, ended as ``mode`` says (by default
        with an assistant turn opened), with ``tools`` offered (through the template when it takes
        them, else through ``tool_calls.fallback_conversation``), and tokenizes.

        The template writes the special tokens itself, so none are added while tokenizing;
        special-token text inside a content is tokenized as plain text (``chat_encoding``), so a
        message cannot open or close turns.

        Raises:
            InvalidRequestError: field ``chat`` when the model has no chat template;
                ``chat.messages`` when there are no messages or more than the limit, or when the
                contents together (with the tool calls in the history) exceed ``max_prompt_bytes``;
                ``chat.messages[i].role`` for a role outside ``CHAT_ROLES``; ``chat.messages[i].content``
                for a content over ``max_prompt_bytes``. All checked before rendering. ``chat.messages`` also when the
                template refuses the conversation (it raises, e.g. for roles out of its order), it
                damaged a marked text, or the conversation is nested too deeply (``chat_marks``).
        """
        if self._chat is None:
            raise InvalidRequestError(CHAT_FIELD, f"model {self._info.name} has no chat template; send a prompt")
        self._check_chat(messages)
        try:
            return self._chat.encode([turn.as_openai() for turn in messages], mode, tools)
        except InvalidRequestError as exc:  # named within the chat (``messages``)
            raise exc.renamed(f"{CHAT_FIELD}.{exc.field_name}") from exc
        except (ValueError, jinja2.TemplateError) as exc:
            raise InvalidRequestError(CHAT_FIELD + ".messages", f"the chat template refused them: {exc}") from exc

    def _check_chat(self, messages: Sequence[ChatTurn]) -> None:
        """The chat's size and role checks (see ``encode_chat``)."""
        field = CHAT_FIELD + ".messages"
        if not messages:
            raise InvalidRequestError(field, "must hold at least one message")
        check_count(field, len(messages), self._limits.max_chat_messages, "messages")
        budget = self.max_prompt_bytes
        total = 0
        for i, turn in enumerate(messages):
            check_count(f"{field}[{i}].role", len(turn.role), self._limits.max_role_chars, "characters")
            check_count(f"{field}[{i}].name", len(turn.name or ""), self._limits.max_message_name_chars, "characters")
            if turn.role not in CHAT_ROLES:
                raise InvalidRequestError(f"{field}[{i}].role", f"{turn.role!r} is not one of {', '.join(CHAT_ROLES)}")
            total += check_text_bytes(f"{field}[{i}].content", turn.content, budget)
            total += sum(TOOL_CALL_TEXT_BYTES + check_text_bytes(f"{field}[{i}].tool_calls[{j}]",
                                                                 f"{call.id}{call.name}{call.arguments}", budget)
                         for j, call in enumerate(turn.tool_calls))
            total += check_text_bytes(f"{field}[{i}].tool_call_id", turn.tool_call_id or "", budget)
            if total > budget:
                raise InvalidRequestError(field, f"the contents hold more than {budget} UTF-8 bytes together")

    def check_token_ids(self, ids: Sequence[int]) -> list[int]:
        """Validates client-given prompt token ids against the model's vocabulary.

        Returns:
            the ids as a list of ``int``.

        Raises:
            InvalidRequestError: ``prompt_token_ids.ids`` when empty or not shorter than the context
                (checked before any id); ``prompt_token_ids.ids[i]`` for the first id outside
                ``[0, vocab_size)``.
        """
        if not ids:
            raise InvalidRequestError(TOKEN_IDS_FIELD, "must hold at least one token id")
        check_prompt_length(len(ids), self._info.max_model_len, TOKEN_IDS_FIELD)
        return self.check_vocabulary(ids, TOKEN_IDS_FIELD)

    def check_vocabulary(self, ids: Sequence[int], field: str) -> list[int]:
        """The ids as a list of ``int``; raises InvalidRequestError naming ``field[i]`` for the first id outside
        ``[0, vocab_size)``."""
        vocab_size = self._info.vocab_size
        for i, token_id in enumerate(ids):
            if not 0 <= token_id < vocab_size:
                raise InvalidRequestError(f"{field}[{i}]", f"{token_id} is not in [0, {vocab_size})")
        return [int(token_id) for token_id in ids]
