"""Log-probabilities in the OpenAI API's shapes (and vLLM's ``prompt_logprobs`` extension).

All values are natural logs (``pagedserve.engine.messages.TokenLogprobs``); ``-inf`` is sent as
``-9999.0``, as OpenAI and vLLM do (JSON has no infinity); only a chosen token's can be (no token at
``-inf`` is an alternative, so ``top_logprobs`` has fewer than ``k`` where fewer tokens are possible).
Token strings are the decode of the single token id with special tokens kept (vLLM's ``decoded_token``);
a token that is only part of a UTF-8 character decodes to U+FFFD.

- completions: ``{"tokens": [str], "token_logprobs": [float | null], "top_logprobs":
  [{token: logprob} | null], "text_offset": [int]}``. ``top_logprobs[i]`` holds the ``k`` most
  likely tokens, most likely first, then the chosen token when it is not among them (vLLM's
  layout: ``k + 1`` entries at most, fewer when two tokens decode to the same string).
  ``text_offset[i]`` is the character offset of ``tokens[i]`` in the choice's text: with ``echo``,
  a prompt token's offset in the prompt as sent (a BOS the tokenizer added is not in that text: it
  stands at 0 and takes no room; vLLM counts its string's length, which shifts every later offset),
  then the completion's tokens from the end of the prompt on, as their strings add up (as vLLM
  does). The first prompt position of an ``echo`` has ``null`` logprob and top logprobs.
- chat: ``{"content": [{"token", "logprob", "bytes": [UTF-8 ints], "top_logprobs": [{"token",
  "logprob", "bytes"}]}]}``, ``top_logprobs`` the ``k`` most likely, most likely first; ``bytes``
  are the token's own, also for a piece of a character whose ``token`` is U+FFFD.
- ``prompt_logprobs`` (vLLM, non-streamed completions): one entry per prompt token, ``null``
  first, then ``{str(token_id): {"logprob", "rank", "decoded_token"}}`` for the prompt token and
  its ``k`` most likely alternatives (rank 1-based).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from pydantic import BaseModel

from pagedserve.engine.messages import TokenLogprobs
from pagedserve.services.gateway.openai_samples import EchoPrompt

MIN_LOGPROB = -9999.0
"""What a logprob of ``-inf`` (a token the processing ruled out) is sent as."""


def clamp(logprob: float) -> float:
    """``logprob``, or ``MIN_LOGPROB`` when it is below it (``-inf``) or NaN."""
    return logprob if not math.isnan(logprob) and logprob > MIN_LOGPROB else MIN_LOGPROB


class TokenNames:
    """Token id -> its string (the single id decoded, special tokens kept), cached; and its bytes.

    Args:
        tokenizer: anything with ``decode(ids, skip_special_tokens)`` and ``token_bytes(id, decoded)``
            (a ``PromptTokenizer``).
    """

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self._names: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        name = self._names.get(token_id)
        if name is None:
            name = self._tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self._names) < 1 << 16:
                self._names[token_id] = name
        return name

    def bytes_of(self, token_id: int) -> list[int]:
        """The UTF-8 bytes the token adds to a text (its own for a piece of a character)."""
        return list(self._tokenizer.token_bytes(token_id, self(token_id)))


class CompletionLogprobs(BaseModel):
    """A completions choice's (or chunk's) ``logprobs``; the four lists are parallel."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionOffsets:
    """Formats one completions choice's logprobs chunk after chunk, carrying ``text_offset`` on.

    Args:
        names: token strings.
    """

    def __init__(self, names: TokenNames) -> None:
        self._names = names
        self.offset = 0

    def format(self, token_ids: Sequence[int], entries: Sequence[TokenLogprobs],
               prompt: EchoPrompt | None = None) -> CompletionLogprobs:
        """The logprobs of ``token_ids`` (``entries`` parallel), after those of ``prompt`` (``echo``:
        its tokens at their offsets in its text, its ``logprobs`` the entries, the first ``None``);
        the offsets of ``token_ids`` go on from the end of the prompt's text."""
        out = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        if prompt is not None:
            for token_id, entry, offset in zip(prompt.token_ids, prompt.logprobs, prompt.text_offsets, strict=True):
                self._add(out, token_id, entry, offset)
            self.offset = len(prompt.text)
        for token_id, entry in zip(token_ids, entries, strict=True):
            self._add(out, token_id, entry, self.offset)
            self.offset += len(out.tokens[-1])
        return out

    def _add(self, out: CompletionLogprobs, token_id: int, entry: TokenLogprobs | None, offset: int) -> None:
        token = self._names(token_id)
        out.tokens.append(token)
        out.text_offset.append(offset)
        if entry is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            return
        out.token_logprobs.append(clamp(entry.logprob))
        top = {self._names(t): clamp(lp) for t, lp in zip(entry.top_token_ids, entry.top_logprobs)}
        top.setdefault(token, clamp(entry.logprob))
        out.top_logprobs.append(top)


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(BaseModel):
    """A chat choice's (or chunk's) ``logprobs``."""

    content: list[ChatTokenLogprob] | None


def _chat_top(names: TokenNames, token_id: int, logprob: float) -> ChatTopLogprob:
    token = names(token_id)
    return ChatTopLogprob(token=token, logprob=clamp(logprob), bytes=names.bytes_of(token_id))


def chat_logprobs(names: TokenNames, entries: Sequence[TokenLogprobs]) -> ChatLogprobs:
    """The chat ``logprobs`` object of output tokens' ``entries``."""
    content = []
    for entry in entries:
        chosen = _chat_top(names, entry.token_id, entry.logprob)
        top = [_chat_top(names, t, lp) for t, lp in zip(entry.top_token_ids, entry.top_logprobs)]
        content.append(ChatTokenLogprob(**chosen.model_dump(), top_logprobs=top))
    return ChatLogprobs(content=content)


class PromptLogprob(BaseModel):
    """One token's entry in vLLM's ``prompt_logprobs``."""

    logprob: float
    rank: int | None
    decoded_token: str


def prompt_logprobs_out(names: TokenNames, entries: Sequence[TokenLogprobs | None]
                        ) -> list[dict[str, PromptLogprob] | None]:
    """vLLM's ``prompt_logprobs`` list: ``None`` stays ``None``; an entry becomes
    ``{str(token_id): PromptLogprob}`` for the prompt token (its own rank) and the alternatives
    (rank = position + 1)."""
    out: list[dict[str, PromptLogprob] | None] = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        position = {str(entry.token_id): PromptLogprob(logprob=clamp(entry.logprob), rank=entry.rank,
                                                       decoded_token=names(entry.token_id))}
        for rank, (t, lp) in enumerate(zip(entry.top_token_ids, entry.top_logprobs), start=1):
            position.setdefault(str(t), PromptLogprob(logprob=clamp(lp), rank=rank, decoded_token=names(t)))
        out.append(position)
    return out
