"""Incremental detokenization: token ids in, text deltas out, never half a character.

Decoding one token at a time is wrong for two reasons: a token may carry only some bytes of a
UTF-8 character (byte-level BPE pieces, SentencePiece byte-fallback tokens), and a decoder may
render a token differently at the start of a text than after other tokens (SentencePiece drops the
leading space of the first piece). So each step decodes a small window of tokens twice:

* ``tokens[prefix:read]``: tokens already turned into text, kept only as context;
* ``tokens[prefix:]``: the same plus the tokens not yet emitted.

The new text is what the second decode has beyond the first (which is cached). While it ends in
U+FFFD (the replacement character decoders write for incomplete bytes), the pending tokens are held
back; once it does not, the text is emitted and the window slides forward (``prefix = read``,
``read = len(tokens)``). Each step decodes a window of a few tokens, so the cost per token does
not grow with the length of the output.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"

# Prompt tokens decoded as context before the first output token (enough for any leading-space rule).
PROMPT_CONTEXT_TOKENS = 6
# Most output tokens held back at once; past it the pending text is emitted as the decoder gives it,
# so a long run of tokens that add no text (skipped special tokens) or only broken bytes still costs
# O(1) each. A real character needs at most 4 byte tokens, so only such runs ever reach it.
MAX_PENDING_TOKENS = 32


class TokenDecoder(Protocol):
    """What the detokenizer needs of a tokenizer (a Hugging Face tokenizer qualifies)."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool) -> str: ...


class IncrementalDetokenizer:
    """Turns one request's output token ids into text deltas.

    The text continues the prompt: up to ``PROMPT_CONTEXT_TOKENS`` prompt tokens serve as decode
    context, so a first output token with a leading-space marker keeps its space after the prompt.
    For decoders that treat the start of a text like any other position (byte-level BPE, as in the
    default model), the concatenation of all deltas plus ``finish()`` equals
    ``tokenizer.decode(output_ids, skip_special_tokens=...)`` exactly. For SentencePiece decoders
    that strip the first space of a decoded text, it equals the decoded prompt-plus-output text
    beyond the decoded prompt instead (so it may start with a space that ``decode(output_ids)`` drops).

    Args:
        tokenizer: decodes ids to text (``decode(ids, skip_special_tokens=...)``).
        prompt_token_ids: the request's prompt; only its last few ids are used, as context.
        skip_special_tokens: leave special tokens out of the text.
        spaces_between_special_tokens: False passes ``spaces_between_special_tokens=False`` to the
            tokenizer's decode (Hugging Face slow tokenizers then join special tokens without a
            space, as vLLM does; fast tokenizers, the default model's included, ignore it).
    """

    def __init__(self, tokenizer: TokenDecoder, prompt_token_ids: Sequence[int], skip_special_tokens: bool,
                 spaces_between_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._decode_options = {} if spaces_between_special_tokens else {"spaces_between_special_tokens": False}
        self._tokens: list[int] = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._prefix_text = self._decode(self._tokens)
        if self._prefix_text.endswith(REPLACEMENT_CHAR):
            # The prompt ends inside a character: its bytes cannot be context for the output's.
            self._tokens = []
            self._prefix_text = ""
        self._prefix_offset = 0
        self._read_offset = len(self._tokens)

    @property
    def num_pending_tokens(self) -> int:
        """Output tokens received whose text has not been emitted yet."""
        return len(self._tokens) - self._read_offset

    def add(self, token_ids: Sequence[int]) -> str:
        """Appends output tokens and returns the text they complete (possibly ``""``).

        Text is held back while it ends in U+FFFD, i.e. while a character may still be incomplete,
        and while the new tokens add no text (they may change how the next ones decode).
        """
        if not token_ids:
            return ""
        self._tokens.extend(token_ids)
        new_text = self._decode(self._tokens[self._prefix_offset :])
        complete = len(new_text) > len(self._prefix_text) and not new_text.endswith(REPLACEMENT_CHAR)
        if not (complete or self.num_pending_tokens > MAX_PENDING_TOKENS):
            return ""
        return self._emit(new_text)

    def finish(self) -> str:
        """Returns the text still held back, at the end of the request.

        Bytes that never completed a character are emitted as the decoder renders them (U+FFFD).
        Calling it again returns ``""``.
        """
        if not self.num_pending_tokens:
            return ""
        return self._emit(self._decode(self._tokens[self._prefix_offset :]))

    def _emit(self, new_text: str) -> str:
        """Returns the text past the context and slides the window over the tokens just emitted."""
        delta = new_text[len(self._prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        self._prefix_text = self._decode(self._tokens[self._prefix_offset : self._read_offset])
        if self._prefix_offset > 4 * MAX_PENDING_TOKENS:  # drop ids no window will reach again
            del self._tokens[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return delta

    def _decode(self, token_ids: list[int]) -> str:
        if not token_ids:
            return ""
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens, **self._decode_options)
