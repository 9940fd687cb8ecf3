"""Request bodies of the OpenAI-compatible HTTP API (pydantic), every list and string bounded.

Field names, types and defaults follow OpenAI's API and vLLM's extensions. Sizes that depend on
the model (prompt bytes and tokens against the context) are checked later, by the tokenizer;
the bounds here stop oversized bodies before any work is spent on them. Nothing is silently
ignored: a field pagedserve does not implement is refused (400 naming it), except the few listed in
``IgnoredFields`` and ``IGNORED_MESSAGE_FIELDS``, which change nothing it serves. Responses are in
``openai_responses``.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, model_validator

from pagedserve.engine.sampling_checks import BOUNDS, MAX_LOGIT_BIAS
from pagedserve.text.request_limits import RequestLimits
from pagedserve.services.gateway.config import MAX_SERVED_MODEL_NAME_CHARS
from pagedserve.services.gateway.openai_structured import StructuredFields
from pagedserve.services.gateway.openai_tools import CallId, ToolCallIn, ToolFields

_LIMITS = RequestLimits()
MAX_PROMPTS = 64
"""Most prompts in one completions request (each is its own engine request)."""
MAX_NAME_CHARS = MAX_SERVED_MODEL_NAME_CHARS
"""Longest model name (the served one's bound) or user."""

IGNORED_MESSAGE_FIELDS = ("refusal", "annotations", "audio", "function_call")
"""Message fields accepted when null or empty (the openai client sends them back in an assistant
message of the history); with a value they are refused."""

Text = Annotated[StrictStr, Field(max_length=_LIMITS.max_text_chars)]
Name = Annotated[StrictStr, Field(max_length=MAX_NAME_CHARS)]
TokenIds = Annotated[list[StrictInt], Field(max_length=_LIMITS.max_token_ids)]
StopStrings = Annotated[list[Annotated[StrictStr, Field(max_length=_LIMITS.max_stop_string_chars)]],
                        Field(max_length=_LIMITS.max_stop_strings)]
Stop = Annotated[StrictStr, Field(max_length=_LIMITS.max_stop_string_chars)] | StopStrings


class StrictRequest(BaseModel):
    """A request body (or part of one) that refuses unknown fields, but drops the names of
    ``_ignored`` (and of ``_ignored_when_empty`` when null or empty) first."""

    model_config = ConfigDict(extra="forbid")
    _ignored: ClassVar[tuple[str, ...]] = ()
    _ignored_when_empty: ClassVar[tuple[str, ...]] = ()

    @model_validator(mode="before")
    @classmethod
    def _drop_ignored(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        return {key: value for key, value in data.items()
                if key not in cls._ignored and not (key in cls._ignored_when_empty and not value)}


class IgnoredFields(BaseModel):
    """Request fields accepted within bounds and deliberately ignored: an end-user label, OpenAI's stored
    completions and their tags (OpenAI's bounds: 16 pairs, keys of 64 characters, values of 512), and OpenAI's
    processing tier (pagedserve stores nothing and has one tier). They were dropped unread, so a 10 MB ``user``
    or a ``metadata`` of 100,000 keys was accepted (attack of 2026-12-07)."""

    user: Name | None = Field(None, exclude=True)
    store: StrictBool | None = Field(None, exclude=True)
    metadata: Annotated[dict[Annotated[StrictStr, Field(max_length=64)], Annotated[StrictStr, Field(max_length=512)]],
                        Field(max_length=16)] | None = Field(None, exclude=True)
    service_tier: Name | None = Field(None, exclude=True)


IGNORED_FIELDS = tuple(IgnoredFields.model_fields)


class StreamOptions(StrictRequest):
    """``stream_options`` (only with ``stream: true``): ``include_usage`` adds a last chunk with the
    usage and no choices; vLLM's ``continuous_usage_stats`` puts on every chunk the usage so far of
    its choice (its prompt's tokens, the tokens the choice has generated; vLLM sends it only beside
    ``include_usage``, here it also works alone)."""

    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


class SamplingFields(StrictRequest, StructuredFields, IgnoredFields):
    """Fields shared by completions and chat completions (OpenAI's, then vLLM's extensions; the
    structured-output forms are ``StructuredFields``).

    Semantics as vLLM's (``openai_params`` maps them onto ``SamplingParams``). ``logit_bias``
    keys are token ids as decimal strings (OpenAI's JSON form). ``best_of > n`` returns the ``n``
    samples of highest cumulative logprob and cannot be streamed.
    """

    model: Name = Field(description="must be the served model name (GET /v1/models)")
    max_tokens: StrictInt | None = Field(None, description="most tokens to generate per choice")
    temperature: StrictFloat | None = Field(None, description=">= 0; 0 is greedy (default 1)")
    top_p: StrictFloat | None = Field(None, description="nucleus mass in (0, 1] (default 1)")
    top_k: StrictInt | None = Field(None, description="keep the k most likely tokens; -1 or 0 is off")
    min_p: StrictFloat | None = Field(None, description="drop tokens below min_p * p_max (default 0)")
    seed: StrictInt | None = Field(None, description="per-request seed (reproducible sampling)")
    n: StrictInt = Field(1, description=f"choices per prompt, in {BOUNDS['n'].describe()}")
    stop: Stop | None = Field(None, description="stop string(s); not included in the output")
    stop_token_ids: Annotated[list[StrictInt], Field(max_length=_LIMITS.max_stop_token_ids)] | None = None
    ignore_eos: StrictBool = False
    min_tokens: StrictInt = Field(0, description="EOS and stop token ids are held back until this many tokens")
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    spaces_between_special_tokens: StrictBool = True
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    presence_penalty: StrictFloat = 0.0
    frequency_penalty: StrictFloat = 0.0
    repetition_penalty: StrictFloat = 1.0
    logit_bias: Annotated[dict[Annotated[str, Field(max_length=16)], StrictFloat],
                          Field(max_length=MAX_LOGIT_BIAS)] | None = None
    best_of: StrictInt | None = None
    prompt_logprobs: StrictInt | None = None
    allowed_token_ids: TokenIds | None = Field(None, description="the only token ids that may be generated")
    bad_words: StopStrings | None = Field(None, description="words never generated (with or without a leading space)")


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``. ``prompt`` is a string, a list of strings, a list of token ids or
    a list of token-id lists; several prompts give ``len(prompts) * n`` choices, prompt-major."""

    prompt: (Text | Annotated[list[Text], Field(min_length=1, max_length=MAX_PROMPTS)] | TokenIds
             | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)])
    max_tokens: StrictInt | None = Field(16, description="most tokens to generate per choice (default 16)")
    logprobs: StrictInt | None = Field(None, description="logprobs of each token and this many top alternatives, "
                                       f"{BOUNDS['logprobs'].describe()}")
    echo: StrictBool = Field(False, description="the prompt before the completion (with logprobs: its logprobs too)")
    suffix: Text | None = Field(None, description="not supported")
    add_special_tokens: StrictBool = Field(True, description="text prompts get the tokenizer's special tokens (BOS)")

    @property
    def scores_prompt(self) -> bool:
        """``echo`` with ``max_tokens`` 0: the prompt (with its logprobs when asked) and no completion,
        as lm-evaluation-harness scores prompts."""
        return self.echo and self.max_tokens == 0


class TextPart(StrictRequest):
    """A text part of a message's content."""

    type: Literal["text"]
    text: Text


class ChatMessage(StrictRequest):
    """One chat message; ``content`` is a string or a list of text parts (joined). An assistant
    message may hold the ``tool_calls`` it made, a ``tool`` message the ``tool_call_id`` it answers;
    ``name`` reaches the chat template (``message.name``)."""

    _ignored_when_empty = IGNORED_MESSAGE_FIELDS

    role: Annotated[StrictStr, Field(max_length=_LIMITS.max_role_chars)]
    content: Text | Annotated[list[TextPart], Field(max_length=_LIMITS.max_chat_messages)] | None = None
    name: Annotated[StrictStr, Field(max_length=_LIMITS.max_message_name_chars)] | None = None
    tool_calls: Annotated[list[ToolCallIn], Field(max_length=_LIMITS.max_chat_messages)] | None = None
    tool_call_id: CallId | None = None

    def text(self) -> str:
        """The content as one string ("" for none)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields, ToolFields):
    """``POST /v1/chat/completions``: ``messages`` rendered with the model's chat template, with
    ``tools`` offered (``openai_tools``)."""

    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=_LIMITS.max_chat_messages)]
    max_completion_tokens: StrictInt | None = Field(None, description="OpenAI's newer name of max_tokens")
    add_generation_prompt: StrictBool = Field(True, description="open an assistant turn after the messages")
    continue_final_message: StrictBool = Field(False, description="leave the last message open and continue it")
    logprobs: StrictBool = Field(False, description="logprobs of each output token")
    top_logprobs: StrictInt | None = Field(
        None, description=f"top alternatives per token, {BOUNDS['logprobs'].describe()}; needs logprobs")


class TokenizeRequest(StrictRequest):
    """``POST /tokenize``: either ``prompt`` or ``messages`` (rendered as for chat completions)."""

    model: Name | None = None
    prompt: Text | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=_LIMITS.max_chat_messages)] | None = None
    add_special_tokens: StrictBool = Field(True, description="for prompt: add BOS etc. as the tokenizer does")
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False


class DetokenizeRequest(StrictRequest):
    """``POST /detokenize``: token ids to text (special tokens kept)."""

    model: Name | None = None
    tokens: TokenIds
