"""Turns a client's GenerateRequest into validated parts: prompt token ids, sampling parameters and
tool use."""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.services.common.pb import generate_pb2 as gen
from pagedserve.services.common.pb_fields import from_pb
from pagedserve.engine.sampling_params import InvalidRequestError, SamplingParams
from pagedserve.text.request_limits import RequestLimits, check_count
from pagedserve.text.request_samples import ParsedRequest, parse_request
from pagedserve.text.tokenizer import PromptTokenizer
from pagedserve.text.tool_use import ToolUse
from pagedserve.services.gateway.grpc_tools import chat_tool_use, chat_turns

_SAMPLING_FIELDS = frozenset(gen.SamplingParams.DESCRIPTOR.fields_by_name)


def grpc_field_name(field_name: str) -> str:
    """A bare field name as this API spells it: ``sampling_params.top_p`` for a SamplingParams
    field, ``prompt`` or ``chat.messages[0].role`` (GenerateRequest's own) unchanged."""
    root = field_name.split("[", 1)[0].split(".", 1)[0]
    return f"sampling_params.{field_name}" if root in _SAMPLING_FIELDS else field_name


def check_request_sizes(request: gen.GenerateRequest, limits: RequestLimits) -> None:
    """Checks the sizes of the request's lists and strings other than the prompt (cheap, done first).

    Raises:
        InvalidRequestError: ``request_id``, ``cache_salt``, ``stop``, ``stop[i]``, ``bad_words``,
            ``bad_words[i]``, ``stop_token_ids`` or ``allowed_token_ids`` beyond its bound in
            ``limits`` (bare names).
    """
    check_count("request_id", len(request.request_id), limits.max_request_id_chars, "characters")
    check_count("cache_salt", len(request.cache_salt), limits.max_cache_salt_chars, "characters")
    msg = request.sampling_params
    for name in ("stop", "bad_words"):
        strings = getattr(msg, name)
        check_count(name, len(strings), limits.max_stop_strings, "strings")
        for i, text in enumerate(strings):
            check_count(f"{name}[{i}]", len(text), limits.max_stop_string_chars, "characters")
    check_count("stop_token_ids", len(msg.stop_token_ids), limits.max_stop_token_ids, "token ids")
    check_count("allowed_token_ids", len(msg.allowed_token_ids), limits.max_token_ids, "token ids")


def sampling_params_from_pb(msg: gen.SamplingParams) -> SamplingParams:
    """The API message as validated SamplingParams, by field name (unset fields: the defaults).

    Raises:
        InvalidRequestError: a value out of range; the message names the field. ``best_of``
            above ``n``: this API streams, and a streamed sample cannot be taken back.
    """
    params = from_pb(msg, SamplingParams)
    if params.best_of is not None and params.best_of > params.n:
        raise InvalidRequestError("best_of", f"{params.best_of} is more than n: the gRPC API streams "
                                  "every sample, so best_of > n is only supported by the offline LLM")
    return params


def prompt_token_ids_from_pb(request: gen.GenerateRequest, tokenizer: PromptTokenizer,
                             tool_use: ToolUse) -> tuple[list[int], str]:
    """Tokenizes whichever prompt input the request holds (a chat with ``tool_use``'s tools offered);
    returns the ids and the field's name.

    Raises:
        InvalidRequestError: no prompt input, an empty one, an unknown chat role, bad tool use in
            the history, invalid token ids.
    """
    kind = request.WhichOneof("prompt_input")
    if kind == "prompt":
        return tokenizer.encode_prompt(request.prompt), "prompt"
    if kind == "chat":
        turns = chat_turns(request.chat, tokenizer.limits)
        return tokenizer.encode_chat(turns, tools=tool_use.tools), "chat"
    if kind == "prompt_token_ids":
        return tokenizer.check_token_ids(list(request.prompt_token_ids.ids)), "prompt_token_ids"
    raise InvalidRequestError("prompt", "one of prompt, chat or prompt_token_ids must be set")


@dataclass(frozen=True)
class GenerateInput:
    """A validated GenerateRequest.

    Attributes:
        parsed: the tokenized request, its sampling parameters constrained to calls when
            ``tool_use`` asks it.
        tool_use: the chat's tools and what it asks of them (``NONE`` without tools, and for a
            prompt or token ids).
    """

    parsed: ParsedRequest
    tool_use: ToolUse


def parse_generate_request(request: gen.GenerateRequest, tokenizer: PromptTokenizer) -> GenerateInput:
    """Validates and tokenizes a GenerateRequest (the gateway and `pagedserve complete --offline`).

    Sizes are checked before anything is tokenized (``tokenizer.limits``).

    Raises:
        InvalidRequestError: any invalid field, named as this API spells it (``grpc_field_name``).
    """
    try:
        check_request_sizes(request, tokenizer.limits)
        is_chat = request.WhichOneof("prompt_input") == "chat"
        tool_use = chat_tool_use(request.chat, tokenizer.limits) if is_chat else ToolUse()
        params = tool_use.constrain(sampling_params_from_pb(request.sampling_params))
        ids, field_name = prompt_token_ids_from_pb(request, tokenizer, tool_use)
        parsed = parse_request(tokenizer, ids, field_name, params, request.priority, request.cache_salt)
        return GenerateInput(parsed, tool_use)
    except InvalidRequestError as exc:
        raise exc.renamed(grpc_field_name(exc.field_name)) from exc
