"""What the engine hands its front ends: per request and step, one ``RequestOutput`` per sample.

Built by keyword or through the named constructors (:meth:`RequestOutput.taken`,
:meth:`RequestOutput.aborted`); ``pagedserve/services/common/convert.py`` maps them to ``TokenEvent``
messages between the scheduler and the gateway.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

from pagedserve.engine.messages import AcceptedDraft, BatchPlan, FinishReason, RequestError, SampledToken, TokenLogprobs


class OutputKind(enum.Enum):
    """What an output reports."""

    TOKENS = "tokens"  # new tokens and/or the finish (or failure) of one sample
    TAKEN = "taken"  # a scheduler took the request from its queue (no tokens yet): the gateway stops watching it


@dataclass(frozen=True, kw_only=True)
class RequestOutput:
    """What one iteration produced for one request, for the front end.

    Attributes:
        request_id: the request.
        kind: what the output reports; a ``TAKEN`` output has no tokens and no finish.
        first_output_index: position in the output of ``new_token_ids[0]`` (0 for the first token).
        new_token_ids: tokens generated in this iteration (several when drafts were accepted).
        finish_reason: set once per sample, on its last output.
        error: set when the request was aborted because it cannot be served.
        sample_index: which of the request's ``n`` samples the tokens belong to.
        logprobs: when the request asks for ``logprobs``: one entry per ``new_token_ids`` entry; else empty.
        prompt_logprobs: when the request asks for ``prompt_logprobs``: on sample 0's first output
            only, one entry per prompt position 1..P-1 (position 0 has none); else ``None``.
        stop_token_id: the id from ``stop_token_ids`` that finished the sample (vLLM's
            ``stop_reason`` for a stop token); ``None`` otherwise (EOS, length, abort).
    """

    request_id: str
    kind: OutputKind = OutputKind.TOKENS
    first_output_index: int = 0
    new_token_ids: tuple[int, ...] = ()
    finish_reason: FinishReason | None = None
    error: RequestError | None = None
    sample_index: int = 0
    logprobs: tuple[TokenLogprobs, ...] = ()
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None
    stop_token_id: int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @classmethod
    def taken(cls, request_id: str) -> RequestOutput:
        """A scheduler took ``request_id`` from its queue (the gateway stops checking its queue entry)."""
        return cls(request_id=request_id, kind=OutputKind.TAKEN)

    @classmethod
    def emitted(cls, request_id: str, sample_index: int, first_output_index: int,
                tokens: tuple[AcceptedDraft | SampledToken, ...], finish_reason: FinishReason | None,
                stop_token_id: int | None, prompt_logprobs: tuple[TokenLogprobs, ...] | None) -> RequestOutput:
        """The output of tokens a step emitted for a sample (accepted drafts, then the sampled token),
        with the logprobs entries they carry.

        Made once per running sample and step, so it skips the generated ``__init__``, which sets each of a
        frozen dataclass's ten fields through ``object.__setattr__``: one ``__dict__`` update of the fields that
        may differ from their defaults (class attributes: ``kind`` and ``error`` keep theirs) makes an equal,
        as frozen, output; 0.53 us against 1.88 on the Zen 4 EPYC, the scheduler 1.18x faster at 256 running
        (docs/benchmarks.md). A field added with a ``default_factory`` must be set here."""
        if len(tokens) == 1:  # no draft accepted
            token_ids, logprobs = (tokens[0].token_id,), () if tokens[0].logprobs is None else (tokens[0].logprobs,)
        else:
            token_ids = tuple([t.token_id for t in tokens])
            logprobs = tuple([t.logprobs for t in tokens if t.logprobs is not None])
        output = object.__new__(cls)
        output.__dict__.update(request_id=request_id, first_output_index=first_output_index, new_token_ids=token_ids,
                               finish_reason=finish_reason, sample_index=sample_index, logprobs=logprobs,
                               prompt_logprobs=prompt_logprobs, stop_token_id=stop_token_id)
        return output

    @classmethod
    def aborted(cls, request_id: str, error: RequestError | None = None, *, sample_index: int = 0,
                first_output_index: int = 0) -> RequestOutput:
        """The last output of a sample stopped before its end: reason ``abort``, with ``error``
        when it cannot be served (``None``: its client or the server aborted it)."""
        return cls(request_id=request_id, first_output_index=first_output_index, finish_reason=FinishReason.ABORT,
                   error=error, sample_index=sample_index)


@dataclass(frozen=True)
class SchedulerOutput:
    """What one ``schedule`` call produced.

    Attributes:
        plans: one plan per worker that has something to do, keyed by worker id.
        outputs: outputs made while scheduling (requests refused as too large for any worker,
            sequences that filled a whole worker and end with ``length``).
    """

    plans: Mapping[str, BatchPlan]
    outputs: tuple[RequestOutput, ...] = ()
