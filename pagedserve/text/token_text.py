"""Where a token's text is: each prompt token's character offset in the text it was encoded from,
and the UTF-8 bytes a token adds to a text, also when it carries only part of a character (its
string alone is then U+FFFD)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from pagedserve.text.detokenizer import REPLACEMENT_CHAR

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
"""A SentencePiece byte-fallback piece (Llama's ``<0xE6>``): the one byte it names."""


class MisalignedText(ValueError):
    """The token ids are not an encoding of the text (with or without the tokenizer's special tokens)."""


def text_offsets(tokenizer: Any, text: str, token_ids: Sequence[int]) -> list[int]:
    """The character offset in ``text`` where each of ``token_ids`` starts, from the tokenizer's
    offset mapping (pieces of one character share its offset). Special tokens the tokenizer put
    around the text (a BOS) are not in it: those before stand at 0, those after at ``len(text)``.

    Args:
        tokenizer: a Hugging Face fast tokenizer (offset mappings).
        text: the text as the client sent it.
        token_ids: ``text`` encoded, with or without the tokenizer's special tokens.

    Raises:
        MisalignedText: ``token_ids`` does not hold the text's plain encoding as one run.
    """
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    plain, spans = list(encoding["input_ids"]), encoding["offset_mapping"]
    ids = list(token_ids)
    extra = len(ids) - len(plain)
    start = next((k for k in range(extra + 1) if ids[k:k + len(plain)] == plain), None)
    if start is None:
        raise MisalignedText(f"{len(ids)} token ids are not an encoding of a text of {len(plain)} tokens")
    return [0] * start + [begin for begin, _ in spans] + [len(text)] * (extra - start)


class TokenBytes:
    """The bytes a token adds to a decoded text (OpenAI's ``bytes`` of a logprob entry).

    A token that is only part of a UTF-8 character decodes alone to U+FFFD; its own bytes come from
    its vocabulary piece: a byte-level BPE piece (GPT-2's alphabet: one printable character per
    byte, as in the default model) or a SentencePiece byte-fallback piece ``<0xNN>``.

    Args:
        tokenizer: a Hugging Face tokenizer (``convert_ids_to_tokens``, ``added_tokens_decoder``).
    """

    def __init__(self, tokenizer: Any) -> None:
        from tokenizers import decoders
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        self._tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self._byte_of = ({char: byte for byte, char in bytes_to_unicode().items()}
                         if isinstance(decoder, decoders.ByteLevel) else {})
        self._added = frozenset(tokenizer.added_tokens_decoder)

    def __call__(self, token_id: int, decoded: str) -> bytes:
        """The bytes of ``token_id``, whose string alone is ``decoded``: ``decoded`` in UTF-8, or,
        where it holds U+FFFD, the bytes its piece stands for (when the piece is a byte piece)."""
        if REPLACEMENT_CHAR not in decoded or token_id in self._added:
            return decoded.encode("utf-8")
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        byte_piece = _BYTE_PIECE.fullmatch(piece)
        if byte_piece is not None:
            return bytes([int(byte_piece.group(1), 16)])
        if self._byte_of and all(char in self._byte_of for char in piece):
            return bytes(self._byte_of[char] for char in piece)
        return decoded.encode("utf-8")
