"""Gathering a request's samples for the OpenAI handlers: whole responses (with ``best_of``
selection, as the offline ``LLM`` does) and ``echo`` of the prompt in streams."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from pagedserve.engine.messages import FinishReason, TokenLogprobs
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.llm_outputs import SampleCollector, SampleOutput, best_samples
from pagedserve.text.request_samples import ParsedRequest
from pagedserve.services.gateway.generation_core import SampleDelta, Usage


@dataclass
class PromptSamples:
    """One engine request's samples while they arrive (``params.num_samples`` of them).

    Attributes:
        params: the request's sampling parameters (``n``, ``best_of``, ``logprobs``).
        collectors: one per engine sample.
        prompt_logprobs: sample 0's prompt logprobs (one per prompt token, the first ``None``)
            when the request asked for them.
    """

    params: SamplingParams
    collectors: list[SampleCollector]
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None

    @classmethod
    def of(cls, params: SamplingParams) -> PromptSamples:
        return cls(params, [SampleCollector() for _ in range(params.num_samples)])

    def add(self, sample: SampleDelta) -> None:
        self.collectors[sample.sample_index].add(sample.delta)
        if sample.delta.prompt_logprobs is not None:
            self.prompt_logprobs = sample.delta.prompt_logprobs

    def best(self) -> tuple[SampleOutput, ...]:
        """The ``n`` samples to return: all, or with ``best_of > n`` the ``n`` with the highest
        cumulative logprob, best first (``SampleOutput.logprobs`` only when the client asked)."""
        outputs = [c.output(i, self.params) for i, c in enumerate(self.collectors)]
        return best_samples(outputs, self.params)


async def collect_samples(events: AsyncIterator[tuple[int, SampleDelta]], parsed: Sequence[ParsedRequest]
                          ) -> tuple[list[PromptSamples], list[Usage]]:
    """Every delta of ``events`` (``(prompt index, delta)``, as ``merged_outputs`` yields them)
    gathered per prompt, and the usage of each finished request."""
    results = [PromptSamples.of(p.params) for p in parsed]
    usages = []
    async for prompt_index, sample in events:
        results[prompt_index].add(sample)
        if sample.usage is not None:
            usages.append(sample.usage)
    return results, usages


@dataclass(frozen=True)
class EchoPrompt:
    """What ``echo`` puts before a choice: the prompt's text (as sent, or its ids decoded with
    special tokens), token ids and each token's character offset in that text, and the prompt
    logprobs (with ``logprobs``; first ``None``)."""

    text: str
    token_ids: tuple[int, ...]
    text_offsets: tuple[int, ...]
    logprobs: tuple[TokenLogprobs | None, ...] | None = None


@dataclass
class StreamEcho:
    """Puts each prompt before its choices' first chunk in a stream.

    With ``logprobs``, the prompt logprobs come on sample 0's first delta only; a choice whose
    first delta comes before that waits (its deltas are held, then released in order).

    Args:
        prompts: per prompt index, its text and ids.
        with_logprobs: the client asked for logprobs (so the prompt's come first).
    """

    prompts: list[EchoPrompt]
    with_logprobs: bool
    _started: set[tuple[int, int]] = field(default_factory=set)
    _waiting: dict[int, list[SampleDelta]] = field(default_factory=dict)

    def ready(self, prompt_index: int, sample: SampleDelta) -> list[tuple[int, SampleDelta, EchoPrompt | None]]:
        """The deltas to send now, each with the prompt to put before it (on a choice's first
        chunk) or ``None``."""
        prompt = self.prompts[prompt_index]
        if sample.delta.prompt_logprobs is not None:
            prompt = self.prompts[prompt_index] = dataclasses.replace(prompt, logprobs=sample.delta.prompt_logprobs)
        if self.with_logprobs and prompt.logprobs is None:
            self._waiting.setdefault(prompt_index, []).append(sample)
            return []
        out = []
        for held in self._waiting.pop(prompt_index, []) + [sample]:
            key = (prompt_index, held.sample_index)
            out.append((prompt_index, held, None if key in self._started else prompt))
            self._started.add(key)
        return out


async def prompt_only(events: AsyncIterator[tuple[int, SampleDelta]]) -> AsyncIterator[tuple[int, SampleDelta]]:
    """The deltas of a prompt-scoring request (``echo`` with ``max_tokens`` 0, which the engine
    serves by generating one token, as vLLM does) without that token: no text, ids or logprobs, no
    completion tokens, and a choice that ended by itself ends by ``length`` (0 tokens asked, 0 given).
    Closing it closes ``events``."""
    try:
        async for prompt_index, sample in events:
            reason = sample.delta.finish_reason
            delta = dataclasses.replace(sample.delta, text="", token_ids=(), logprobs=(), num_output_tokens=0,
                                        finish_reason=FinishReason.LENGTH if reason is FinishReason.STOP else reason,
                                        stop_reason=None)
            usage = None if sample.usage is None else dataclasses.replace(sample.usage, completion_tokens=0)
            yield prompt_index, SampleDelta(sample.sample_index, delta, usage)
    finally:
        await events.aclose()
