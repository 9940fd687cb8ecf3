"""Client text in a chat, kept from forging the tokenizer's added tokens (``chat_encoding``).

Every string of a conversation that spells an added token (``<|im_start|>``, ``</s>``, ...) is
replaced by a unique random mark before the template renders it: a content, a message's name, a
call's id, name or arguments, a tool's description or parameters, keys of JSON documents included.
The rendered text is split at the marks; template pieces are tokenized as usual, and each mark's
text with special-token matching off, so the client's text stays characters.

A content is written by templates as it is. Other strings may be written raw (``{{ message.name }}``)
or through ``tojson`` (arguments, tools), which escapes quotes, backslashes and control characters;
a string that spells an added token and holds such a character would need one text or the other,
and which the template used cannot be told, so it is refused. A template that transforms a marked
string (upper case, truncation) leaves a damaged mark; that chat is refused too.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from pagedserve.engine.request_errors import InvalidRequestError

MARK_PREFIX = "PAGEDSERVETEXT"

_DOCUMENTS = frozenset({"arguments", "parameters"})
"""Keys whose values are JSON documents a client wrote whole: strings inside one are named by its path."""

_UNNAMED = frozenset({"function"})
"""OpenAI-shape levels the gRPC API does not have (its calls and tools are flat): left out of field names."""


class TextMarks:
    """The marks of one rendering and the texts they stand for.

    Args:
        added: the tokenizer's added tokens' texts.
    """

    def __init__(self, added: Sequence[str]) -> None:
        ordered = sorted(added, key=len, reverse=True)
        self._added = re.compile("|".join(map(re.escape, ordered))) if ordered else None
        self._texts: dict[str, str] = {}

    def __bool__(self) -> bool:
        return bool(self._texts)

    def spells_added_token(self, text: str) -> bool:
        return self._added is not None and self._added.search(text) is not None

    def mark(self, text: str) -> str:
        """A new mark standing for ``text`` (tokenized as plain text where the template writes it)."""
        mark = f"{MARK_PREFIX}{uuid.uuid4().hex}"
        self._texts[mark] = text
        return mark

    def conversation(self, conversation: Sequence[dict[str, Any]], inserted: int) -> list[dict[str, Any]]:
        """The conversation with every string that spells an added token marked; ``inserted``
        messages were put before the client's (fields are named by the client's indexes).

        Raises:
            InvalidRequestError: ``messages[i]...`` for a string that cannot be marked (module docstring).
        """
        return [{key: self._content(value) if key == "content" else
                 self._leaves(value, f"messages[{max(i - inserted, 0)}].{key}", key in _DOCUMENTS)
                 for key, value in message.items()} for i, message in enumerate(conversation)]

    def tools(self, tools: Sequence[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        """The tools (OpenAI's shape) with every string that spells an added token marked.

        Raises:
            InvalidRequestError: ``tools[j]...`` for a string that cannot be marked.
        """
        return None if tools is None else [self._leaves(tool, f"tools[{j}]", False) for j, tool in enumerate(tools)]

    def tokenize(self, rendered: str, encode_template: Callable[[str], list[int]],
                 encode_plain: Callable[[str], list[int]]) -> list[int]:
        """Token ids of ``rendered``: marks as their texts' plain-text ids, the rest with ``encode_template``.

        Raises:
            InvalidRequestError: ``messages``: the template changed a mark as it wrote it.
        """
        ids: list[int] = []
        pieces = re.split("(" + "|".join(self._texts) + ")", rendered) if self._texts else [rendered]
        for piece in pieces:
            if piece in self._texts:
                ids += encode_plain(self._texts[piece]) if self._texts[piece] else []
            elif MARK_PREFIX.lower() in piece.lower():
                raise InvalidRequestError("messages", "the chat template changed a text that spells a special token "
                                                      "as it wrote it (case, truncation), so it cannot be kept as text")
            elif piece:
                ids += encode_template(piece)
        return ids

    def _content(self, text: Any) -> Any:
        return self.mark(text) if isinstance(text, str) and self.spells_added_token(text) else text

    def _leaves(self, value: Any, path: str, inside_document: bool) -> Any:
        if isinstance(value, str):
            if not self.spells_added_token(value):
                return value
            if json.dumps(value, ensure_ascii=False)[1:-1] != value:
                raise InvalidRequestError(path, "spells a special token and holds a character JSON escapes (a quote, "
                                                "backslash or control character): the chat template may write it raw "
                                                "or escaped, so it cannot be kept as text; send one or the other")
            return self.mark(value)
        if isinstance(value, dict):
            return {self._leaves(key, path, True): self._leaves(
                item, path if inside_document or key in _UNNAMED else f"{path}.{key}", inside_document or key in _DOCUMENTS)
                for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return [self._leaves(item, path if inside_document else f"{path}[{i}]", inside_document)
                    for i, item in enumerate(value)]
        return value
