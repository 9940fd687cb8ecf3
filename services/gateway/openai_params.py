"""OpenAI request fields -> ``SamplingParams``: the one place where the HTTP API's sampling
fields are mapped (and where new ones get wired)."""

from __future__ import annotations

import dataclasses

from pagedserve.engine.sampling_params import InvalidRequestError, SamplingParams
from services.gateway.openai_protocol import ChatCompletionRequest, CompletionRequest, SamplingFields

_ENGINE_PREFIX = "sampling_params."


def _not_yet(request: SamplingFields) -> list[tuple[str, object, object]]:
    """(field, value, default) of every accepted-but-not-wired field."""
    fields = [
        ("presence_penalty", request.presence_penalty, 0.0),
        ("frequency_penalty", request.frequency_penalty, 0.0),
        ("repetition_penalty", request.repetition_penalty, 1.0),
        ("logit_bias", request.logit_bias or None, None),
        ("best_of", request.best_of, (None, request.n)),
        ("prompt_logprobs", request.prompt_logprobs, None),
        ("spaces_between_special_tokens", request.spaces_between_special_tokens, True),
    ]
    if isinstance(request, CompletionRequest):
        fields += [("logprobs", request.logprobs, None), ("echo", request.echo, False),
                   ("suffix", request.suffix or None, None)]
    if isinstance(request, ChatCompletionRequest):
        fields += [("logprobs", request.logprobs, False), ("top_logprobs", request.top_logprobs, None)]
    return fields


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


def sampling_params_from_openai(request: SamplingFields) -> SamplingParams:
    """The validated ``SamplingParams`` of an OpenAI completions or chat request (unset fields
    take ``SamplingParams``' defaults; ``user`` is ignored).

    Raises:
        InvalidRequestError: a value out of range or a field not supported yet; ``field_name`` is
            the OpenAI field's name (``temperature``, not ``sampling_params.temperature``).
    """
    check_supported(request)
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
