"""In-process messages of the engine: frozen dataclasses mirroring proto/engine.proto.

The scheduler produces a ``BatchPlan`` per worker per iteration; the worker answers with a
``StepResult``; the scheduler turns results into ``RequestOutput`` events for the front end
(``outputs.py``).
The plan carries deltas, as vLLM V1's scheduler output does: a request travels in full once
(``NewRequestData``), then only as ``CachedRequestData`` (new block ids, tokens scheduled now).
``pagedserve/services/common/convert.py`` maps these to and from protobuf at process boundaries.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

from pagedserve.engine.request_errors import ErrorKind
from pagedserve.engine.sampling_params import EngineSamplingParams


class FinishReason(enum.Enum):
    """Why a request stopped (the OpenAI API's ``finish_reason`` values)."""

    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"  # aborted by the client or the server


@dataclass(frozen=True)
class EngineRequest:
    """A tokenized request as the engine receives it.

    Attributes:
        request_id: unique among requests in flight.
        prompt_token_ids: the prompt, ``len >= 1``.
        sampling: token-level sampling parameters.
        arrival_time: unix time in seconds when the front end accepted it (orders FCFS).
        trace_context: W3C trace context carriers (``traceparent``) for the request's trace.
        priority: lower runs first under the priority policy (ignored by FCFS).
        cache_salt: mixed into prefix-cache hashes: only requests with the same salt share blocks.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: EngineSamplingParams
    arrival_time: float
    trace_context: Mapping[str, str] = field(default_factory=dict)
    priority: int = 0
    cache_salt: str = ""

    def __post_init__(self) -> None:
        """Raises ValueError for a request no scheduler could serve (the gateway never makes one)."""
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id!r}: the prompt is empty")
        if self.sampling.max_tokens < 1 or self.sampling.n < 1:
            raise ValueError(f"request {self.request_id!r}: max_tokens and n must be at least 1")


@dataclass(frozen=True)
class ResumedSample:
    """What the client already received of one sample of a request, when another scheduler takes
    the request over (request migration: ``Scheduler.resume_request``).

    Attributes:
        sample_index: which of the request's ``n`` samples, in ``[0, n)``.
        output_token_ids: the sample's output tokens delivered so far, in order.
        finished: the client got the sample's last output (it does not run again).
    """

    sample_index: int
    output_token_ids: tuple[int, ...]
    finished: bool


@dataclass(frozen=True, order=True)
class SequenceId:
    """The engine's key for one sequence: sample ``sample_index`` of request ``request_id``.

    A request with ``n`` samples runs as ``n`` sequences (sample 0 first, samples 1..n-1 forked
    after the prompt). The key is typed, not a concatenated string, so no request id a client
    could send can name another request's sample.
    """

    request_id: str
    sample_index: int = 0

    def __str__(self) -> str:
        return f"{self.request_id}/{self.sample_index}"


@dataclass(frozen=True)
class NewRequestData:
    """A request scheduled on a worker for the first time, or again after preemption.

    Attributes:
        token_ids: prompt followed by the tokens generated so far.
        num_prompt_tokens: how many of ``token_ids`` are the prompt.
        block_ids: the block table, logical block index -> physical block id.
        num_computed_tokens: tokens whose K/V already sit in the blocks.
        num_scheduled_tokens: tokens to compute in this iteration (a prefill chunk, or 1 to decode).
        sampling: the sequence's sampling parameters (stop token ids only when ``min_tokens`` needs them).
    """

    seq_id: SequenceId
    token_ids: tuple[int, ...]
    num_prompt_tokens: int
    block_ids: tuple[int, ...]
    num_computed_tokens: int
    num_scheduled_tokens: int
    sampling: EngineSamplingParams
    trace_context: Mapping[str, str] = field(default_factory=dict)

    @property
    def request_id(self) -> str:
        """The request the sequence is a sample of."""
        return self.seq_id.request_id


@dataclass(frozen=True)
class CachedRequestData:
    """A sequence the worker already holds: what changed since the last iteration.

    Attributes:
        new_block_ids: physical blocks appended to its block table.
        num_computed_tokens: tokens computed before this iteration, as the scheduler counts them.
        num_scheduled_tokens: tokens to compute in this iteration.
        num_lookahead_tokens: KV slots reserved past the scheduled tokens (speculative decoding):
            the most draft tokens the worker may propose and verify in this step (0: none).
    """

    seq_id: SequenceId
    new_block_ids: tuple[int, ...]
    num_computed_tokens: int
    num_scheduled_tokens: int
    num_lookahead_tokens: int = 0

    @property
    def request_id(self) -> str:
        """The request the sequence is a sample of."""
        return self.seq_id.request_id


@dataclass(frozen=True)
class BatchPlan:
    """One iteration's work for one worker.

    Attributes:
        step_id: this plan's number in its worker session (1, 2, ...: ``WorkerState.num_steps``); the worker
            runs a session's plans in this order whatever order they arrive in (``PlanOrder``).
        new_requests: requests sent in full.
        cached_requests: deltas for requests the worker holds.
        finished_seq_ids: sequences whose worker state must be dropped (finished, aborted,
            preempted, swapped out) before this iteration runs.
        blocks_to_swap_out: ``(device block, cpu block)`` copies to make first.
        blocks_to_swap_in: ``(cpu block, device block)`` copies to make next.
        blocks_to_copy: ``(source block, destination block)`` device copies (copy-on-write), last.
        session_id: the scheduler's session with this worker, new each time a scheduler admits
            (or re-admits) it; a worker that sees a new one drops every sequence it holds (the
            accounting they were made under is gone).
    """

    step_id: int
    new_requests: tuple[NewRequestData, ...] = ()
    cached_requests: tuple[CachedRequestData, ...] = ()
    finished_seq_ids: tuple[SequenceId, ...] = ()
    blocks_to_swap_out: tuple[tuple[int, int], ...] = ()
    blocks_to_swap_in: tuple[tuple[int, int], ...] = ()
    blocks_to_copy: tuple[tuple[int, int], ...] = ()
    session_id: str = ""

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(r.num_scheduled_tokens for r in self.new_requests) + sum(
            r.num_scheduled_tokens for r in self.cached_requests
        )

    @property
    def is_empty(self) -> bool:
        return not (self.new_requests or self.cached_requests or self.finished_seq_ids
                    or self.blocks_to_swap_out or self.blocks_to_swap_in or self.blocks_to_copy)


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probabilities at one position (vLLM's ``Logprob`` entries, OpenAI's ``logprobs`` item).

    All values are natural logs computed in float32 on the worker. For an output token they are
    the log-softmax of the logits after the request's own processing (min_tokens masking,
    ``logit_bias``, penalties, temperature; no temperature when greedy) and before top-k, top-p
    and min-p truncation; for a prompt token, the log-softmax of the raw logits.

    Attributes:
        token_id: the token at this position (the sampled one, or the prompt's).
        logprob: its log-probability.
        rank: its 1-based rank: how many tokens have a logprob >= its own (1 = most likely), as vLLM counts.
        top_token_ids: the ``k`` most likely tokens (``k`` = the request's ``logprobs`` or
            ``prompt_logprobs``), most likely first; may include ``token_id``; fewer where fewer than
            ``k`` tokens are possible (none at ``-inf``: ruled out by a grammar, ``min_tokens``, ``bad_words``
            or ``allowed_token_ids``).
        top_logprobs: their log-probabilities, parallel to ``top_token_ids``.
    """

    token_id: int
    logprob: float
    rank: int
    top_token_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


@dataclass(frozen=True)
class PromptLogprobs:
    """Prompt logprobs a worker computed for one chunk of a sequence's prompt.

    Attributes:
        seq_id: the sequence (always sample 0 of its request).
        first_position: prompt position (>= 1) of ``entries[0]``; position 0 has no logprob.
        entries: one per prompt position from ``first_position`` on, consecutive.
    """

    seq_id: SequenceId
    first_position: int
    entries: tuple[TokenLogprobs, ...]


@dataclass(frozen=True)
class AcceptedDraft:
    """A draft token a speculative step verified and kept (``spec_decode``).

    Attributes:
        token_id: the token.
        logprob: as :attr:`SampledToken.logprob`, under the target's distribution at its position.
        logprobs: when the request asks for ``logprobs``: as plain decoding would report them.
    """

    token_id: int
    logprob: float
    logprobs: TokenLogprobs | None = None


@dataclass(frozen=True)
class SampledToken:
    """A token sampled for a sequence whose scheduled tokens reached the end of its known tokens.

    Attributes:
        seq_id: the sequence that ran.
        logprob: natural log of its probability under the distribution it was drawn from
            (after temperature, top-k, top-p and min-p; 0.0 for greedy).
        sample_index: the sample the token belongs to: the sequence's own, except for the first
            tokens of a prompt with ``n > 1``, which start samples 0..n-1 (``n`` tokens from the
            prompt's logits, one per sample).
        logprobs: when the request asks for ``logprobs``: the token's logprob, rank and top alternatives.
        grammar_error: set when the sequence's grammar matcher had failed before this token was
            drawn (a parser limit, or a replayed output it refused): the token is not the
            structure's, and the sequence ends with this message (INVALID_ARGUMENT).
        accepted: in a speculative step, the draft tokens accepted, in order: they come before
            ``token_id`` (then the correction or bonus token) in the output.
        num_draft_tokens: drafts the step verified for the sequence (``len(accepted)`` or more).
    """

    seq_id: SequenceId
    token_id: int
    logprob: float
    sample_index: int = 0
    logprobs: TokenLogprobs | None = None
    grammar_error: str | None = None
    accepted: tuple[AcceptedDraft, ...] = ()
    num_draft_tokens: int = 0

    @property
    def request_id(self) -> str:
        """The request the sequence is a sample of."""
        return self.seq_id.request_id


@dataclass(frozen=True)
class StepResult:
    """A worker's answer to a BatchPlan: one sampled token (with the drafts accepted before it) per
    request that completed its prompt, and the prompt logprobs of the prompt chunks computed for requests that ask for them."""

    step_id: int
    sampled: tuple[SampledToken, ...] = ()
    prompt_logprobs: tuple[PromptLogprobs, ...] = ()


@dataclass(frozen=True)
class RequestError:
    """Why the engine could not serve a request; each front end maps ``kind`` to its own status."""

    kind: ErrorKind
    message: str
