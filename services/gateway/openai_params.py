"""OpenAI request fields -> ``SamplingParams``: the one place where the HTTP API's sampling
fields are mapped (and where new ones get wired)."""

from __future__ import annotations

import dataclasses

from pagedserve.engine.sampling_params import MAX_LOGPROBS, InvalidRequestError, SamplingParams
from services.gateway.openai_protocol import ChatCompletionRequest, CompletionRequest, SamplingFields

_ENGINE_PREFIX = "sampling_params."


def _not_yet(request: SamplingFields) -> list[tuple[str, object, object]]:
    """(field, value, default) of every accepted-but-not-wired field (only ``suffix`` now)."""
    if isinstance(request, CompletionRequest):
        return [("suffix", request.suffix or None, None)]
    return []


def check_supported(request: SamplingFields) -> None:
    """Refuses fields the server accepts but cannot serve yet, when set to a non-default value.

    Raises:
        InvalidRequestError: naming the first such field ("... is not supported yet").
    """
    for name, value, default in _not_yet(request):
        defaults = default if isinstance(default, tuple) else (default,)
        if value not in defaults:
            raise InvalidRequestError(name, f"{value!r} is not supported yet (only the default {defaults[0]!r})")


def _max_tokens(request: SamplingFields) -> int | None:
    if isinstance(request, ChatCompletionRequest) and request.max_completion_tokens is not None:
        return request.max_completion_tokens
    return request.max_tokens


def logit_bias_of(bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's ``logit_bias`` (JSON object: token id as a decimal string -> bias in [-100, 100])
    as token id -> bias.

    Raises:
        InvalidRequestError: ``logit_bias``, for a key that is not an integer.
    """
    parsed: dict[int, float] = {}
    for key, value in (bias or {}).items():
        digits = key.strip()
        # ASCII digits only: int() would also take "1_0", "+5" and other scripts' digits
        if not (digits.isascii() and digits.isdigit()):
            raise InvalidRequestError("logit_bias", f"keys must be token ids (decimal integers), got {key!r}")
        parsed[int(digits)] = value
    return parsed


def _logprobs_fields(request: SamplingFields) -> dict[str, int | None]:
    """``logprobs`` and ``prompt_logprobs`` of SamplingParams (counts of top alternatives, 0..20).

    Completions: ``logprobs`` is the count; ``echo`` with ``logprobs`` also asks for the prompt's
    (``prompt_logprobs`` = ``logprobs`` unless set). Chat: ``logprobs: true`` asks for them with
    ``top_logprobs`` alternatives (default 0).

    Raises:
        InvalidRequestError: ``top_logprobs`` out of [0, 20] or set without ``logprobs: true``;
            ``prompt_logprobs`` with ``stream: true``, or on chat.
    """
    prompt_logprobs = request.prompt_logprobs
    if prompt_logprobs is not None and request.stream:
        raise InvalidRequestError("prompt_logprobs", "is not supported with stream: true (as in vLLM)")
    if isinstance(request, CompletionRequest):
        logprobs = request.logprobs
        if request.echo and logprobs is not None and prompt_logprobs is None:
            prompt_logprobs = logprobs
        return {"logprobs": logprobs, "prompt_logprobs": prompt_logprobs}
    assert isinstance(request, ChatCompletionRequest)
    top = request.top_logprobs
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise InvalidRequestError("top_logprobs", f"must be in [0, {MAX_LOGPROBS}], got {top}")
    if top is not None and not request.logprobs:
        raise InvalidRequestError("top_logprobs", "needs logprobs: true")
    if prompt_logprobs is not None:
        raise InvalidRequestError("prompt_logprobs", "is only supported by /v1/completions")
    return {"logprobs": (top or 0) if request.logprobs else None, "prompt_logprobs": None}


def _check_best_of(request: SamplingFields) -> None:
    """Raises InvalidRequestError(``best_of``) for ``best_of > n`` with ``stream``: choices are
    picked once every sample has finished, so they cannot be streamed (as vLLM refused it)."""
    if request.stream and request.best_of is not None and request.best_of > request.n:
        raise InvalidRequestError("best_of", f"{request.best_of} > n={request.n} cannot be streamed; "
                                  "set stream to false or best_of to n")


def sampling_params_from_openai(request: SamplingFields) -> SamplingParams:
    """The validated ``SamplingParams`` of an OpenAI completions or chat request (unset fields
    take ``SamplingParams``' defaults; ``user`` is ignored).

    Raises:
        InvalidRequestError: a value out of range or a field not supported; ``field_name`` is
            the OpenAI field's name (``temperature``, not ``sampling_params.temperature``).
    """
    check_supported(request)
    _check_best_of(request)
    defaults = SamplingParams()
    stop = (request.stop,) if isinstance(request.stop, str) else tuple(request.stop or ())
    values = dict(
        max_tokens=_max_tokens(request),
        temperature=defaults.temperature if request.temperature is None else request.temperature,
        top_p=defaults.top_p if request.top_p is None else request.top_p,
        top_k=defaults.top_k if request.top_k is None else request.top_k,
        min_p=defaults.min_p if request.min_p is None else request.min_p,
        seed=request.seed,
        min_tokens=request.min_tokens,
        stop=stop,
        stop_token_ids=tuple(request.stop_token_ids or ()),
        ignore_eos=request.ignore_eos,
        include_stop_str_in_output=request.include_stop_str_in_output,
        skip_special_tokens=request.skip_special_tokens,
        n=request.n,
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        repetition_penalty=request.repetition_penalty,
        logit_bias=logit_bias_of(request.logit_bias),
        best_of=request.best_of,
        spaces_between_special_tokens=request.spaces_between_special_tokens,
        **_logprobs_fields(request),
    )
    try:
        return SamplingParams(**values)
    except InvalidRequestError as exc:
        raise openai_field_error(exc) from exc


def openai_field_error(exc: InvalidRequestError) -> InvalidRequestError:
    """``exc`` with the field named as the OpenAI API names it (engine prefix dropped; a
    ``max_tokens`` error of a chat request stays ``max_tokens``)."""
    name = exc.field_name.removeprefix(_ENGINE_PREFIX)
    return InvalidRequestError(name, exc.reason)


SUPPORTED_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))
"""``SamplingParams`` fields the mapping above sets (a test checks none is forgotten)."""
