"""Client text in a chat, kept from forging the tokenizer's added tokens (``chat_encoding``).

Every added token's text that a client string of a conversation holds (in a content, a message's
name, a call's id, name or arguments, a tool's description or parameters, keys of JSON documents
included) is replaced by a unique random mark before the template renders it; so is a piece of one
that could join the template's own text into a token: a string that is a piece of an added token
(a JSON key ``|im_start|`` that a template writes as ``<{{ key }}>``), or that ends with a token's
beginning or starts with its end (``<filename`` before a template's ``>``); pieces of at least 2
characters, one of them not a letter, digit or ``_`` (words inside tokens, ``start`` or ``user``, stay).
A message's role and the structure's own keys are not client text and stay. The rendered text is
split at the marks; template pieces are tokenized as usual and each mark's text with special-token
matching off, so the client's text stays characters.

Only the marked substrings leave the text: a template writes the rest as it would have, raw or through
``tojson``. Added tokens with characters JSON escapes (whitespace tokens) are not marked: the two
writings would differ. A template that transforms a marked substring (upper case, truncation) leaves a
damaged mark, and that chat is refused.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from pagedserve.engine.request_errors import InvalidRequestError

MARK_PREFIX = "PAGEDSERVETEXT"

MIN_PIECE_CHARS = 2
"""The shortest piece of an added token that is marked at a string's edge or as a whole string."""

_DOCUMENTS = frozenset({"arguments", "parameters"})
"""Keys whose values are JSON documents a client wrote whole: their keys are client text too."""

_NOT_TEXT = frozenset({"role"})
"""Message keys whose values are not free text (a role is checked against the chat roles)."""


def _is_piece(text: str) -> bool:
    return len(text) >= MIN_PIECE_CHARS and not text.replace("_", "").isalnum()


class AddedTokenText:
    """The added tokens' texts a client string is searched for, built once per tokenizer.

    Args:
        added: the tokenizer's added tokens' texts.
    """

    def __init__(self, added: Sequence[str]) -> None:
        markers = sorted((t for t in added if t.strip() and json.dumps(t, ensure_ascii=False)[1:-1] == t),
                         key=len, reverse=True)
        self.whole = re.compile("|".join(map(re.escape, markers))) if markers else None
        self.beginnings = {p for t in markers for n in range(MIN_PIECE_CHARS, len(t)) if _is_piece(p := t[:n])}
        self.ends = {p for t in markers for n in range(1, len(t) - MIN_PIECE_CHARS + 1) if _is_piece(p := t[n:])}
        self.inner = {p for t in markers for i in range(len(t)) for j in range(i + MIN_PIECE_CHARS, len(t) + 1)
                      if (i, j) != (0, len(t)) and _is_piece(p := t[i:j])}
        self.longest = max(map(len, markers), default=0)


class TextMarks:
    """The marks of one rendering and the texts they stand for (a fresh random prefix per rendering,
    so that no client text can pass for a mark).

    Args:
        tokens: the tokenizer's ``AddedTokenText``.
    """

    def __init__(self, tokens: AddedTokenText) -> None:
        self._tokens = tokens
        self._prefix = f"{MARK_PREFIX}{uuid.uuid4().hex[:12]}"
        self._texts: dict[str, str] = {}

    def __bool__(self) -> bool:
        return bool(self._texts)

    def mark(self, text: str) -> str:
        """A new mark standing for ``text`` (tokenized as plain text where the template writes it)."""
        mark = f"{self._prefix}{uuid.uuid4().hex}"
        self._texts[mark] = text
        return mark

    def structure(self, value: Any) -> Any:
        """An OpenAI-shaped message or tool with its client text marked (``text``); its own keys and a
        message's role stay, the JSON documents in it (``arguments``, ``parameters``) are marked whole."""
        if isinstance(value, dict):
            return {key: item if key in _NOT_TEXT else self.text(item) if key in _DOCUMENTS else self.structure(item)
                    for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.structure(item) for item in value]
        return self.text(value)

    def text(self, value: Any) -> Any:
        """``value`` (a string, or a JSON-like structure of them, keys included) with every added
        token's text in it, and every piece of one at a string's edges or as a whole string, marked."""
        if isinstance(value, str):
            return self._string(value)
        if isinstance(value, dict):
            return {self.text(key): self.text(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.text(item) for item in value]
        return value

    def tokenize(self, rendered: str, encode_template: Callable[[str], list[int]],
                 encode_plain: Callable[[str], list[int]]) -> list[int]:
        """Token ids of ``rendered``: marks as their texts' plain-text ids, the rest with ``encode_template``.

        Raises:
            InvalidRequestError: ``messages``: the template changed a mark as it wrote it.
        """
        ids: list[int] = []
        for piece in re.split(f"({re.escape(self._prefix)}[0-9a-f]{{32}})", rendered):
            if piece in self._texts:
                ids += encode_plain(self._texts[piece])
            elif self._prefix.lower() in piece.lower():
                raise InvalidRequestError("messages", "the chat template changed a text that spells a special token "
                                                      "as it wrote it (case, truncation), so it cannot be kept as text")
            elif piece:
                ids += encode_template(piece)
        return ids

    def _string(self, text: str) -> str:
        tokens = self._tokens
        if tokens.whole is None or not text:
            return text
        if text in tokens.inner:
            return self.mark(text)
        head = next((n for n in range(min(len(text), tokens.longest), MIN_PIECE_CHARS - 1, -1)
                     if text[:n] in tokens.ends), 0)
        tail = next((n for n in range(min(len(text) - head, tokens.longest), MIN_PIECE_CHARS - 1, -1)
                     if text[len(text) - n:] in tokens.beginnings), 0)
        middle = tokens.whole.sub(lambda match: self.mark(match.group()), text[head:len(text) - tail])
        return (self.mark(text[:head]) if head else "") + middle + (self.mark(text[len(text) - tail:]) if tail else "")
