"""``POST /v1/completions``: prompts in, ``text_completion`` objects (or SSE chunks) out.

Several prompts are separate engine requests; choice ``index`` is ``prompt_index * n +
sample_index`` (prompt-major, as OpenAI and vLLM number them).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from opentelemetry import trace
from starlette.requests import Request
from starlette.responses import Response

from pagedserve.engine.messages import TokenLogprobs
from pagedserve.engine.sampling_params import InvalidRequestError
from pagedserve.llm_outputs import SampleOutput
from pagedserve.text.request_samples import ParsedRequest, parse_request
from pagedserve.text.token_text import MisalignedText
from pagedserve.text.tokenizer import TOKEN_IDS_FIELD, PromptTokenizer
from pagedserve.services.gateway.generation_core import SampleDelta
from pagedserve.services.gateway.generation_errors import GenerationError, naming_failures
from pagedserve.services.gateway.openai_params import sampling_params_from_openai
from pagedserve.services.gateway.openai_protocol import CompletionRequest, StreamOptions
from pagedserve.services.gateway.openai_responses import (
    CompletionChoice, CompletionChunk, CompletionResponse, CompletionWholeChoice, ResponseMeta, UsageInfo,
    finish_reason_name,
)
from pagedserve.services.gateway.openai_logprobs import CompletionOffsets, TokenNames, prompt_logprobs_out
from pagedserve.services.gateway.openai_samples import EchoPrompt, StreamEcho, collect_samples, prompt_only
from pagedserve.services.gateway.openai_serving import (
    SSE_DONE, OpenAIServing, StreamUsage, open_generation, sse_event, unless_disconnected, with_first,
)
from pagedserve.services.gateway.openai_errors import error_event
from pagedserve.services.gateway.openai_structured import structured_output_of


def _prompt_ids(tokenizer: PromptTokenizer, prompt: str | list[int], field: str, add_special_tokens: bool) -> list[int]:
    """Token ids of one prompt (text, with the tokenizer's special tokens such as BOS when
    ``add_special_tokens``, or ids). Raises InvalidRequestError naming ``field``."""
    try:
        if isinstance(prompt, str) and add_special_tokens:
            return tokenizer.encode_prompt(prompt)
        if isinstance(prompt, str):
            return tokenizer.encode_prompt_without_special_tokens(prompt)
        return tokenizer.check_token_ids(prompt)
    except InvalidRequestError as exc:
        raise InvalidRequestError(field + exc.field_name.removeprefix(TOKEN_IDS_FIELD).removeprefix("prompt"),
                                  exc.reason) from exc


def parse_completion(body: CompletionRequest, tokenizer: PromptTokenizer) -> list[ParsedRequest]:
    """One parsed request per prompt (CPU work: run it off the event loop).

    Raises:
        InvalidRequestError: any invalid field, named as the OpenAI API names it.
    """
    params = sampling_params_from_openai(body)
    prompt = body.prompt
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) or not prompt:
        prompts, fields = [prompt], ["prompt"]
    else:
        prompts, fields = list(prompt), [f"prompt[{i}]" for i in range(len(prompt))]
    parsed = [parse_request(tokenizer, ids, field, params)
              for ids, field in ((_prompt_ids(tokenizer, p, f, body.add_special_tokens), f)
                                 for p, f in zip(prompts, fields))]
    _check_repeated_prompt_logprobs(body, parsed,
                                    tokenizer.limits.max_prompt_logprob_entries(tokenizer.info.max_model_len))
    return parsed


def _check_repeated_prompt_logprobs(body: CompletionRequest, parsed: list[ParsedRequest], limit: int) -> None:
    """Raises InvalidRequestError (``echo``, or ``prompt_logprobs``) when the response would carry more than
    ``limit`` prompt logprob entries (``RequestLimits.prompt_logprobs_per_context_token``): each choice holds
    its prompt's in ``prompt_logprobs`` and, echoed with ``logprobs``, in ``logprobs`` again."""
    alternatives = parsed[0].engine_params.prompt_logprobs if parsed else None
    if alternatives is None:
        return
    copies = 1 + (body.echo and body.logprobs is not None)
    entries = copies * body.n * sum(len(p.prompt_token_ids) for p in parsed) * (alternatives + 1)
    if entries > limit:
        field = "prompt_logprobs" if body.prompt_logprobs is not None else "echo"
        raise InvalidRequestError(field, f"each of the n = {body.n} choices repeats its prompt's logprobs: {entries} "
                                         f"entries ({copies} x choices x prompt tokens x (alternatives + 1)), more "
                                         f"than {limit}; ask for fewer choices, alternatives or prompt tokens")


async def create_completion(serving: OpenAIServing, body: CompletionRequest, request: Request) -> Response:
    """Serves one completions request, streamed or whole.

    Raises:
        GenerationError: the request cannot be served (the HTTP layer maps its kind to a status);
            errors after a stream started are sent as an SSE error event instead.
    """
    parsed, span, events = await open_generation(serving, body.model, lambda: parse_completion(body, serving.tokenizer),
                                                 "gateway.http.completions")
    events = naming_failures(events, structured_output_of(body)[1])
    meta = ResponseMeta.new("cmpl", serving.model_name)
    names = TokenNames(serving.tokenizer)
    try:
        echo = await asyncio.to_thread(echo_prompts, body, parsed, serving.tokenizer, names) if body.echo else None
    except BaseException:
        span.end()
        raise
    shape = ChoiceShape(body.n, echo, names)
    if body.scores_prompt:
        events = prompt_only(events)
    if not body.stream:
        try:
            return await unless_disconnected(request, _whole(events, meta, shape, parsed))
        finally:
            span.end()
    try:
        first = await unless_disconnected(request, anext(events))
    except BaseException:
        span.end()
        raise
    usage = StreamUsage(body.stream_options or StreamOptions(), tuple(len(p.prompt_token_ids) for p in parsed))
    stream = _stream(first, events, meta, shape, body.logprobs is not None, usage, span)
    return serving.event_stream(stream)


def echo_prompts(body: CompletionRequest, parsed: list[ParsedRequest], tokenizer: PromptTokenizer,
                 names: TokenNames) -> list[EchoPrompt]:
    """Each prompt as ``echo`` puts it before its choices (CPU work: run it off the event loop): a
    text prompt as sent, its tokens at their offsets in it; token ids decoded with special tokens
    kept, their offsets as the token strings add up (vLLM's)."""
    texts = [body.prompt] if isinstance(body.prompt, str) else body.prompt if isinstance(body.prompt[0], str) else None
    prompts = []
    for i, p in enumerate(parsed):
        ids = p.prompt_token_ids
        if texts is None:
            prompts.append(EchoPrompt(tokenizer.decode(ids, skip_special_tokens=False), ids, _joined_offsets(names, ids)))
            continue
        try:
            offsets = tuple(tokenizer.text_offsets(texts[i], ids))
        except MisalignedText:  # not seen with fast tokenizers (offsets come from the text's encoding)
            offsets = _joined_offsets(names, ids)
        prompts.append(EchoPrompt(texts[i], ids, offsets))
    return prompts


def _joined_offsets(names: TokenNames, token_ids: tuple[int, ...]) -> tuple[int, ...]:
    """Each token's offset in the token strings joined."""
    return tuple(itertools.accumulate((len(names(t)) for t in token_ids[:-1]), initial=0))


@dataclass(frozen=True)
class ChoiceShape:
    """How choices are numbered and formatted: ``n`` per prompt, the echoed prompts (or None)
    and the token strings of logprobs."""

    n: int
    echo: list[EchoPrompt] | None
    names: TokenNames


def _whole_choice(index: int, sample: SampleOutput, prompt: EchoPrompt | None, names: TokenNames,
                  prompt_logprobs: tuple[TokenLogprobs | None, ...] | None) -> CompletionWholeChoice:
    """A non-streamed choice: the echoed prompt (text and logprobs) then the sample's."""
    text = sample.text if prompt is None else prompt.text + sample.text
    if prompt is not None:
        prompt = dataclasses.replace(prompt, logprobs=prompt_logprobs)
    logprobs = None if sample.logprobs is None else CompletionOffsets(names).format(sample.token_ids, sample.logprobs,
                                                                                     prompt)
    return CompletionWholeChoice(
        index=index, text=text, logprobs=logprobs, finish_reason=finish_reason_name(sample.finish_reason),
        stop_reason=sample.stop_reason,
        prompt_logprobs=None if prompt_logprobs is None else prompt_logprobs_out(names, prompt_logprobs))


async def _whole(events: AsyncIterator[tuple[int, SampleDelta]], meta: ResponseMeta, shape: ChoiceShape,
                 parsed: list[ParsedRequest]) -> Response:
    results, usages = await collect_samples(events, parsed)

    def body() -> str:  # CPU work (RequestLimits.prompt_logprobs_per_context_token): off the loop
        choices = []
        for prompt_index, result in enumerate(results):
            prompt = None if shape.echo is None else shape.echo[prompt_index]
            for j, sample in enumerate(result.best()):
                choices.append(_whole_choice(prompt_index * shape.n + j, sample, prompt, shape.names,
                                             result.prompt_logprobs))
        return CompletionResponse(**meta.fields(), choices=choices, usage=UsageInfo.of(usages)).model_dump_json()

    return Response(await asyncio.to_thread(body), media_type="application/json")


@dataclass
class _Held:
    """A streamed choice's tokens whose text is still held back (stop-string look-ahead): their
    ids and logprobs go with the choice's next chunk."""

    ids: list[int] = field(default_factory=list)
    entries: list[TokenLogprobs] = field(default_factory=list)

    def chunk_choice(self, index: int, text: str, sample: SampleDelta | None, prompt: EchoPrompt | None,
                     offsets: CompletionOffsets | None) -> CompletionChoice:
        """A chunk's choice: ``text`` (after the echoed prompt on the choice's first chunk) with the
        held tokens' logprobs (``offsets`` None: none asked); ``sample`` set: the choice's finish."""
        ids, entries = self.ids, self.entries
        self.ids, self.entries = [], []
        if prompt is not None:
            text = prompt.text + text
        logprobs = None if offsets is None else offsets.format(ids, entries, prompt)
        return CompletionChoice(index=index, text=text, logprobs=logprobs,
                                finish_reason=None if sample is None else finish_reason_name(sample.delta.finish_reason),
                                stop_reason=None if sample is None else sample.delta.stop_reason)


def _chunk_choices(index: int, sample: SampleDelta, prompt: EchoPrompt | None, held: _Held,
                   offsets: CompletionOffsets | None) -> list[CompletionChoice]:
    """The chunks' choices of one delta: its text (none while all of it is held back, unless the
    echoed prompt goes first), then on its last delta the ``finish_reason`` alone with no text."""
    held.ids += sample.delta.token_ids
    held.entries += sample.delta.logprobs
    choices = []
    if sample.delta.text or prompt is not None:
        choices.append(held.chunk_choice(index, sample.delta.text, None, prompt, offsets))
    if sample.delta.finish_reason is not None:
        choices.append(held.chunk_choice(index, "", sample, None, offsets))
    return choices


async def _stream(first: tuple[int, SampleDelta], events: AsyncIterator[tuple[int, SampleDelta]], meta: ResponseMeta,
                  shape: ChoiceShape, with_logprobs: bool, usage: StreamUsage, span: trace.Span) -> AsyncIterator[bytes]:
    """The SSE body: a chunk per delta that completes text (the prompt first with ``echo``), a
    choice's ``finish_reason`` on a chunk of its own with empty text (as OpenAI sends it), each
    with its choice's usage so far when asked, the usage chunk when asked, ``[DONE]``."""
    usages = []
    echo = None if shape.echo is None else StreamEcho(list(shape.echo), with_logprobs)
    offsets: dict[int, CompletionOffsets] = {}
    held: dict[int, _Held] = {}
    try:
        async for prompt_index, sample in with_first(first, events):
            if sample.usage is not None:
                usages.append(sample.usage)
            ready = [(prompt_index, sample, None)] if echo is None else echo.ready(prompt_index, sample)
            for p, s, prompt in ready:
                index = p * shape.n + s.sample_index
                choice_offsets = offsets.setdefault(index, CompletionOffsets(shape.names)) if with_logprobs else None
                so_far = usage.so_far(p, s.delta.num_output_tokens)
                for choice in _chunk_choices(index, s, prompt, held.setdefault(index, _Held()), choice_offsets):
                    yield sse_event(CompletionChunk(**meta.fields(), choices=[choice], usage=so_far))
        if usage.options.include_usage:
            yield sse_event(CompletionChunk(**meta.fields(), choices=[], usage=UsageInfo.of(usages)))
    except GenerationError as exc:
        yield error_event(exc)
    finally:
        await events.aclose()
        span.end()
    yield SSE_DONE
