"""OpenAI request fields -> ``SamplingParams``: the one place where the HTTP API's sampling
fields are mapped (and where new ones get wired)."""

from __future__ import annotations

import dataclasses

from pagedserve.engine.sampling_checks import MAX_LOGPROBS
from pagedserve.engine.sampling_params import InvalidRequestError, SamplingParams
from pagedserve.services.gateway.openai_protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from pagedserve.services.gateway.openai_structured import renamed_structure_error, structured_output_of


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
    if isinstance(request, CompletionRequest) and request.scores_prompt:
        return 1  # the engine generates at least one token; the response leaves it out (openai_samples.prompt_only)
    if isinstance(request, CompletionRequest) and request.max_tokens == 0:
        raise InvalidRequestError("max_tokens", "must be at least 1, got 0 (0 scores the prompt only with echo: true)")
    return request.max_tokens


def logit_bias_of(bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's ``logit_bias`` (JSON object: token id as a decimal string -> bias in [-100, 100])
    as token id -> bias.

    Raises:
        InvalidRequestError: ``logit_bias``, for a key that is not an integer, or two keys naming one
            token id (``"5"`` and ``"05"``: one bias would be dropped).
    """
    parsed: dict[int, float] = {}
    keys: dict[int, str] = {}
    for key, value in (bias or {}).items():
        digits = key.strip()
        # ASCII digits only: int() would also take "1_0", "+5" and other scripts' digits
        if not (digits.isascii() and digits.isdigit()):
            raise InvalidRequestError("logit_bias", f"keys must be token ids (decimal integers), got {key!r}")
        token_id = int(digits)
        if token_id in keys:
            raise InvalidRequestError("logit_bias", f"keys {keys[token_id]!r} and {key!r} both name token id "
                                      f"{token_id}")
        keys[token_id], parsed[token_id] = key, value
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


def _check_stream_fields(request: SamplingFields) -> None:
    """Raises InvalidRequestError(``best_of``) for ``best_of > n`` with ``stream``: choices are
    picked once every sample has finished, so they cannot be streamed (as vLLM refused it); and
    (``stream_options``) for stream options without ``stream``."""
    if request.stream and request.best_of is not None and request.best_of > request.n:
        raise InvalidRequestError("best_of", f"{request.best_of} > n={request.n} cannot be streamed; "
                                  "set stream to false or best_of to n")
    if request.stream_options is not None and not request.stream:
        raise InvalidRequestError("stream_options", "is only for streams (stream: true), as in vLLM; leave it out")


def _given(request: SamplingFields) -> dict[str, object]:
    """The request's fields that ``SamplingParams`` has by the same name, when set (lists as tuples)."""
    values = {name: getattr(request, name) for name in SUPPORTED_FIELDS if name in type(request).model_fields}
    return {name: tuple(v) if isinstance(v, list) else v for name, v in values.items() if v is not None}


def sampling_params_from_openai(request: SamplingFields) -> SamplingParams:
    """The validated ``SamplingParams`` of an OpenAI completions or chat request: each field of the
    same name, by name; then the fields OpenAI spells its own way (``max_completion_tokens``, a
    single ``stop`` string, ``logit_bias`` keys as strings, the logprobs forms). Unset fields take
    ``SamplingParams``' defaults (``openai_protocol.IgnoredFields`` are not read).

    Raises:
        InvalidRequestError: a value out of range or a field not supported, named as the OpenAI
            API names it (the engine's names are bare, as here).
    """
    check_supported(request)
    _check_stream_fields(request)
    stop = (request.stop,) if isinstance(request.stop, str) else tuple(request.stop or ())
    structure, structure_field = structured_output_of(request)
    try:
        return SamplingParams(**_given(request) | dict(
            max_tokens=_max_tokens(request),
            stop=stop,
            logit_bias=logit_bias_of(request.logit_bias),
            structured_output=structure,
            **_logprobs_fields(request),
        ))
    except InvalidRequestError as e:
        raise renamed_structure_error(e, structure_field) from None


SUPPORTED_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))
"""``SamplingParams`` fields the mapping above sets (a test checks none is forgotten)."""
