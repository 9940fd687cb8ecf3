"""Turns a client's GenerateRequest into validated parts: prompt token ids and sampling parameters."""

from __future__ import annotations

from services.common.pb import generate_pb2 as gen
from pagedserve.engine.sampling_params import MAX_LOGIT_BIAS, InvalidRequestError, SamplingParams
from pagedserve.text.request_limits import RequestLimits, check_count
from pagedserve.text.request_samples import ParsedRequest
from pagedserve.text.tokenizer import ChatTurn, PromptTokenizer, check_prompt_length

_SAMPLING = "sampling_params."


def check_request_sizes(request: gen.GenerateRequest, limits: RequestLimits) -> None:
    """Checks the sizes of the request's lists and strings other than the prompt (cheap, done first).

    Raises:
        InvalidRequestError: ``request_id``, ``cache_salt``, ``sampling_params.stop``,
            ``sampling_params.stop[i]``, ``sampling_params.stop_token_ids``, ``sampling_params.n``
            beyond its bound in ``limits``, or ``sampling_params.logit_bias`` beyond 300 entries.
    """
    check_count("request_id", len(request.request_id), limits.max_request_id_chars, "characters")
    check_count("cache_salt", len(request.cache_salt), limits.max_cache_salt_chars, "characters")
    msg = request.sampling_params
    check_count(_SAMPLING + "stop", len(msg.stop), limits.max_stop_strings, "stop strings")
    for i, stop in enumerate(msg.stop):
        check_count(f"{_SAMPLING}stop[{i}]", len(stop), limits.max_stop_string_chars, "characters")
    check_count(_SAMPLING + "stop_token_ids", len(msg.stop_token_ids), limits.max_stop_token_ids, "token ids")
    check_count(_SAMPLING + "logit_bias", len(msg.logit_bias), MAX_LOGIT_BIAS, "entries")
    if msg.HasField("n") and msg.n > limits.max_n:
        raise InvalidRequestError(_SAMPLING + "n", f"must be in [1, {limits.max_n}], got {msg.n}")


def _optional(msg: gen.SamplingParams, name: str, default):
    """The field's value when set, else ``default``."""
    return getattr(msg, name) if msg.HasField(name) else default


def sampling_params_from_pb(msg: gen.SamplingParams) -> SamplingParams:
    """The API message as validated SamplingParams (defaults for unset fields).

    Raises:
        InvalidRequestError: a value out of range; the message names the field. ``best_of``
            above ``n``: this API streams, and a streamed sample cannot be taken back.
    """
    defaults = SamplingParams()
    if msg.HasField("best_of") and msg.best_of > _optional(msg, "n", 1):
        raise InvalidRequestError(_SAMPLING + "best_of", f"{msg.best_of} is more than n: the gRPC API streams "
                                  "every sample, so best_of > n is only supported by the offline LLM")
    return SamplingParams(
        max_tokens=msg.max_tokens if msg.HasField("max_tokens") else None,
        temperature=msg.temperature if msg.HasField("temperature") else defaults.temperature,
        top_p=msg.top_p if msg.HasField("top_p") else defaults.top_p,
        top_k=msg.top_k if msg.HasField("top_k") else defaults.top_k,
        min_p=msg.min_p if msg.HasField("min_p") else defaults.min_p,
        seed=msg.seed if msg.HasField("seed") else None,
        min_tokens=msg.min_tokens,
        stop=tuple(msg.stop),
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        include_stop_str_in_output=msg.include_stop_str_in_output,
        skip_special_tokens=msg.skip_special_tokens if msg.HasField("skip_special_tokens") else True,
        n=msg.n if msg.HasField("n") else 1,
        logprobs=_optional(msg, "logprobs", None),
        prompt_logprobs=_optional(msg, "prompt_logprobs", None),
        presence_penalty=_optional(msg, "presence_penalty", defaults.presence_penalty),
        frequency_penalty=_optional(msg, "frequency_penalty", defaults.frequency_penalty),
        repetition_penalty=_optional(msg, "repetition_penalty", defaults.repetition_penalty),
        logit_bias=dict(msg.logit_bias),
        best_of=_optional(msg, "best_of", None),
        spaces_between_special_tokens=_optional(msg, "spaces_between_special_tokens", True),
    )


def prompt_token_ids_from_pb(request: gen.GenerateRequest, tokenizer: PromptTokenizer) -> tuple[list[int], str]:
    """Tokenizes whichever prompt input the request holds; returns the ids and the field's name.

    Raises:
        InvalidRequestError: no prompt input, an empty one, an unknown chat role, invalid token ids.
    """
    kind = request.WhichOneof("prompt_input")
    if kind == "prompt":
        return tokenizer.encode_prompt(request.prompt), "prompt"
    if kind == "chat":
        turns = [ChatTurn(role=m.role, content=m.content) for m in request.chat.messages]
        return tokenizer.encode_chat(turns), "chat"
    if kind == "prompt_token_ids":
        return tokenizer.check_token_ids(list(request.prompt_token_ids.ids)), "prompt_token_ids"
    raise InvalidRequestError("prompt", "one of prompt, chat or prompt_token_ids must be set")


def parse_generate_request(request: gen.GenerateRequest, tokenizer: PromptTokenizer) -> ParsedRequest:
    """Validates and tokenizes a GenerateRequest (the gateway and the offline API share this).

    Sizes are checked before anything is tokenized (``tokenizer.limits``).

    Raises:
        InvalidRequestError: any invalid field; the message names it.
    """
    check_request_sizes(request, tokenizer.limits)
    params = sampling_params_from_pb(request.sampling_params)
    ids, field_name = prompt_token_ids_from_pb(request, tokenizer)
    info = tokenizer.info
    check_prompt_length(len(ids), info.max_model_len, field_name)
    engine_params = params.to_engine(len(ids), info.max_model_len, info.vocab_size, info.eos_token_ids)
    return ParsedRequest(tuple(ids), params, engine_params, request.priority, request.cache_salt)
