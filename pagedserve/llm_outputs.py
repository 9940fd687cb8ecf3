"""What the offline ``LLM`` returns: finished requests and their samples (vLLM's output layout)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.engine.messages import FinishReason, TokenLogprobs
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.text.output_processor import TextDelta


@dataclass(frozen=True)
class SampleOutput:
    """One sample of a finished request.

    Attributes:
        text: the generated text (stop string cut unless included).
        token_ids: the generated token ids.
        finish_reason: ``stop``, ``length`` or ``abort``.
        logprobs: when the request asked for ``logprobs``: one :class:`TokenLogprobs` per
            ``token_ids`` entry (logprob, 1-based rank, top alternatives); else ``None``.
        cumulative_logprob: the sum of the tokens' logprobs when they were computed (``logprobs``
            set, or ``best_of > n``); else ``None``.
        stop_reason: the stop string that matched, or the ``stop_token_ids`` id that ended the
            sample; ``None`` for EOS, length or abort (vLLM's ``stop_reason``).
        index: the sample's index among the request's samples (before ``best_of`` selection).
    """

    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason
    logprobs: tuple[TokenLogprobs, ...] | None = None
    cumulative_logprob: float | None = None
    stop_reason: str | int | None = None
    index: int = 0


@dataclass(frozen=True)
class CompletionOutput:
    """A finished request: its ``n`` samples (``text``, ``token_ids`` and ``finish_reason`` are sample 0's).

    Attributes:
        prompt_logprobs: when the request asked for ``prompt_logprobs``: one entry per prompt
            token, the first ``None``; else ``None``.
        error: why the engine refused the request, when it did.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    samples: tuple[SampleOutput, ...]
    error: str | None = None
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None

    @property
    def text(self) -> str:
        return self.samples[0].text

    @property
    def token_ids(self) -> tuple[int, ...]:
        return self.samples[0].token_ids

    @property
    def finish_reason(self) -> FinishReason:
        return self.samples[0].finish_reason


@dataclass
class SampleCollector:
    """Gathers one sample's deltas (mutable; used while ``LLM.run_to_completion`` runs)."""

    texts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None

    def add(self, delta: TextDelta) -> None:
        self.texts.append(delta.text)
        self.token_ids.extend(delta.token_ids)
        self.logprobs.extend(delta.logprobs)
        if delta.finish_reason is not None:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason

    def output(self, index: int, params: SamplingParams) -> SampleOutput:
        """The finished sample (logprobs kept only when the client asked for them)."""
        complete = len(self.logprobs) == len(self.token_ids) and bool(self.token_ids)
        cumulative = sum(e.logprob for e in self.logprobs) if complete else None
        return SampleOutput("".join(self.texts), tuple(self.token_ids), self.finish_reason or FinishReason.ABORT,
                            tuple(self.logprobs) if params.logprobs is not None else None, cumulative,
                            self.stop_reason, index)


def best_samples(samples: list[SampleOutput], params: SamplingParams) -> tuple[SampleOutput, ...]:
    """The ``n`` samples to return: all of them, or with ``best_of > n`` the ``n`` with the
    highest cumulative logprob (best first, as vLLM orders them)."""
    if params.num_samples == params.n:
        return tuple(samples)
    ranked = sorted(samples, key=lambda s: -(s.cumulative_logprob if s.cumulative_logprob is not None
                                              else float("-inf")))
    return tuple(ranked[:params.n])
