"""Bounds on the size of every list and string a client may send (checked before any costly work).

A request beyond a bound is refused with ``InvalidRequestError`` (gRPC ``INVALID_ARGUMENT``) whose
message starts with the field's name. The gRPC server's own message-size limit comes first: an
oversized message never reaches these checks.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.engine.request_errors import LONE_SURROGATE, InvalidRequestError
from pagedserve.engine.sampling_checks import check_count  # noqa: F401 (re-exported for the text checks)


@dataclass(frozen=True)
class RequestLimits:
    """Size bounds of a ``GenerateRequest``; the defaults are the gateway's.

    Attributes:
        prompt_bytes_per_context_token: a text prompt (or the chat contents together) may hold at
            most ``max_model_len * prompt_bytes_per_context_token`` UTF-8 bytes (8192 * 32 = 256 KiB
            for the default model). No tokenizer packs 32 bytes of text into one token on average,
            so a prompt refused here would also be refused for its token count; it is refused
            before the tokenizer spends time on it.
        max_chat_messages: most messages in ``chat.messages``.
        max_role_chars: longest ``chat.messages[i].role`` in characters (roles are short words).
        max_message_name_chars: longest ``chat.messages[i].name`` (the author's name), in characters.
        max_stop_strings: most entries in ``sampling_params.stop`` (and in ``bad_words``).
        max_stop_string_chars: longest stop string (and bad word), in characters.
        max_stop_token_ids: most entries in ``sampling_params.stop_token_ids``.
        max_request_id_chars: longest ``request_id``, in characters.
        max_cache_salt_chars: longest ``cache_salt``, in characters.
        max_text_chars: longest string anywhere in an HTTP body, in characters (the prompt's byte
            bound is tighter; this one stops absurd bodies before any other check).
        max_token_ids: longest list of token ids other than the prompt and ``stop_token_ids``
            (``allowed_token_ids``; the model's context bounds a prompt more tightly).
        max_tools: most tools offered in one chat request.
        max_function_name_chars: longest function name, of a tool or a call (OpenAI's bound).
        max_tool_description_chars: longest tool description, in characters.
        max_tool_arguments_chars: longest arguments text of a call in the history, in characters.
        max_tool_call_id_chars: longest call id (of a call in the history, or a tool message's).
        prompt_logprobs_per_context_token: an OpenAI completions response may carry at most
            ``max_model_len * prompt_logprobs_per_context_token`` prompt logprob entries (a token or an
            alternative; 8192 * 64 = 524,288 for the default model): every choice repeats its prompt's,
            in ``prompt_logprobs`` and, with ``echo`` and ``logprobs``, in ``logprobs`` again. A full
            context echoed with 20 alternatives fits (2 x 21 entries a token); a 41 KB request for 8
            prompts of 1,000 ids, n 32 and 20 alternatives (10.8 million) made a 491 MB response whose
            building held the gateway's event loop for 39 s. gRPC sends a prompt's logprobs once.

    Prompt token ids are bounded by the context itself: fewer than ``max_model_len`` of them,
    counted before any id is looked at.

    Raises:
        ValueError: a bound below 1.
    """

    prompt_bytes_per_context_token: int = 32
    max_chat_messages: int = 1024
    max_role_chars: int = 32
    max_message_name_chars: int = 256
    max_stop_strings: int = 64
    max_stop_string_chars: int = 1024
    max_stop_token_ids: int = 1024
    max_request_id_chars: int = 256
    max_cache_salt_chars: int = 256
    max_text_chars: int = 16 << 20
    max_token_ids: int = 1 << 20
    max_tools: int = 128
    max_function_name_chars: int = 64
    max_tool_description_chars: int = 16 << 10
    max_tool_arguments_chars: int = 1 << 20
    max_tool_call_id_chars: int = 256
    prompt_logprobs_per_context_token: int = 64

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if value < 1:
                raise ValueError(f"RequestLimits.{name} must be at least 1, got {value}")

    def max_prompt_bytes(self, max_model_len: int) -> int:
        """Most UTF-8 bytes of prompt text for a model whose context is ``max_model_len`` tokens."""
        return max_model_len * self.prompt_bytes_per_context_token

    def max_prompt_logprob_entries(self, max_model_len: int) -> int:
        """Most prompt logprob entries in one completions response, for a context of ``max_model_len`` tokens."""
        return max_model_len * self.prompt_logprobs_per_context_token


def check_text_bytes(field: str, text: str, limit: int) -> int:
    """Returns the UTF-8 size of ``text`` in bytes.

    Raises:
        InvalidRequestError: more than ``limit`` bytes (a text with more characters than ``limit``
            is refused without being encoded: every character takes at least one byte), or a lone
            surrogate, which is not text (``LONE_SURROGATE``).
    """
    if len(text) > limit:
        raise InvalidRequestError(field, f"holds {len(text)} characters, more than the {limit} UTF-8 bytes allowed")
    try:
        size = len(text.encode())
    except UnicodeEncodeError:
        raise InvalidRequestError(field, LONE_SURROGATE) from None
    if size > limit:
        raise InvalidRequestError(field, f"holds {size} UTF-8 bytes; at most {limit} are allowed")
    return size
