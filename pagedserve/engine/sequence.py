"""A request's state inside the scheduler: its tokens, how many are computed, where it runs."""

from __future__ import annotations

import enum
import itertools

from pagedserve.engine.messages import EngineRequest, FinishReason, PromptLogprobs, SequenceId, TokenLogprobs
from pagedserve.engine.sampling_params import EngineSamplingParams


_arrivals = itertools.count()
"""Numbers sequences in the order they are made (``Sequence.arrival_order``)."""


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and queued again; holds no blocks
    WAITING_FOR_GRAMMAR = "waiting_for_grammar"  # its structured output's grammar is being built: not
                                                 # queued yet, holds no blocks (``Scheduler.hold_request``)
    RUNNING = "running"  # placed on a worker, holds blocks there
    SWAPPED = "swapped"  # preempted by swapping: its blocks wait in its worker's CPU memory
    FINISHED = "finished"


class Sequence:
    """Mutable scheduling state of one request. Only the scheduler changes it.

    A request with ``n > 1`` samples runs as one sequence per sample: the request's own (sample 0)
    and children forked from it after the prompt (``pagedserve/engine/parallel_sampling.py``).

    Attributes:
        request: the immutable request as it arrived.
        seq_id: this sequence's key in the engine (request id, sample index); block tables and
            worker state are keyed by it.
        sampling: its sampling parameters (a child's seed is derived from the request's).
        fork_parent: for a child not yet running: the sequence it forks from.
        output_token_ids: tokens generated so far.
        num_computed_tokens: tokens (of prompt + output) whose K/V are in the worker's cache,
            counting the tokens scheduled in plans already sent.
        num_tokens_in_flight: tokens that plans already sent will sample but whose ids have not
            come back yet (0 unless the scheduler runs ahead of the worker, see ``can_run_ahead``).
        in_flight_worker_id: the worker those tokens come from (``None`` when none is in flight).
        in_flight_steps: the step ids (on that worker) whose answers carry them, oldest first: an
            answer to an older step belongs to another incarnation of the same sequence id (the
            request was aborted and taken again meanwhile, as migration back and forth does).
        num_lookahead_slots: KV slots the step that samples its last token in flight reserved for
            draft tokens (speculative decoding, ``spec_decode/lookahead.py``); 0 when none.
        worker_id: the worker holding its blocks while running or swapped; ``None`` otherwise.
        num_preemptions: how often its blocks were taken back.
        num_worker_losses: how often the worker running it failed or went away.
        prompt_logprobs: for a request asking for ``prompt_logprobs``, until its first output:
            the entries received so far, for prompt positions 1, 2, ...
        arrival_order: when this scheduler made it, counted over the process (``_arrivals``): which
            of two sequences came first, whatever the clocks of the front ends that stamped
            ``request.arrival_time`` (``admission_order``).
    """

    __slots__ = (
        "request",
        "seq_id",
        "sampling",
        "fork_parent",
        "num_prompt_tokens",
        "output_token_ids",
        "status",
        "num_computed_tokens",
        "num_tokens_in_flight",
        "in_flight_worker_id",
        "in_flight_steps",
        "num_lookahead_slots",
        "worker_id",
        "finish_reason",
        "num_preemptions",
        "num_worker_losses",
        "prompt_logprobs",
        "arrival_order",
    )

    def __init__(self, request: EngineRequest, sample_index: int = 0,
                 sampling: EngineSamplingParams | None = None) -> None:
        self.request = request
        self.seq_id = SequenceId(request.request_id, sample_index)
        self.sampling = sampling or request.sampling
        self.fork_parent: Sequence | None = None
        self.num_prompt_tokens = len(request.prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.num_tokens_in_flight = 0
        self.in_flight_worker_id: str | None = None
        self.in_flight_steps: list[int] = []
        self.num_lookahead_slots = 0
        self.worker_id: str | None = None
        self.finish_reason: FinishReason | None = None
        self.num_preemptions = 0
        self.num_worker_losses = 0
        self.prompt_logprobs: list[TokenLogprobs] = []
        self.arrival_order = next(_arrivals)

    @property
    def request_id(self) -> str:
        """The request's id, which every sample's outputs carry."""
        return self.request.request_id

    @property
    def sample_index(self) -> int:
        """Which of the request's ``n`` samples this is."""
        return self.seq_id.sample_index

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens."""
        return self.num_prompt_tokens + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still to compute: the rest of the prompt (or all after preemption), else 1
        (the last token, known or still in flight)."""
        return self.num_tokens + self.num_tokens_in_flight - self.num_computed_tokens

    def can_run_ahead(self) -> bool:
        """Whether its next step may be scheduled now, while tokens of it are still in flight
        (overlap scheduling: the worker feeds the token it sampled last into the next step).

        Not when no more tokens are wanted after those in flight (``max_tokens``), nor when the
        token in flight is the first of a request with ``n > 1`` samples: its samples are forked
        only when those tokens are known (``parallel_sampling``).
        """
        if self.num_tokens_in_flight == 0:
            return True
        wanted = self.sampling.max_tokens - self.num_output_tokens - self.num_tokens_in_flight
        return wanted > 0 and not (self.num_output_tokens == 0 and self.sampling.n > 1)

    def sampling_scheduled(self, worker_id: str, step_id: int) -> None:
        """Step ``step_id``, which computes its last token, was planned on ``worker_id``: one more
        token is in flight."""
        self.num_tokens_in_flight += 1
        self.in_flight_worker_id = worker_id
        self.in_flight_steps.append(step_id)

    def expects(self, worker_id: str, step_id: int) -> bool:
        """Whether the answer of step ``step_id`` on ``worker_id`` carries a token of this sequence."""
        return worker_id == self.in_flight_worker_id and step_id in self.in_flight_steps

    def token_arrived(self) -> None:
        """One token in flight came back (it is appended next)."""
        self.num_tokens_in_flight -= 1
        self.in_flight_steps.pop(0)
        if self.num_tokens_in_flight == 0:
            self.in_flight_worker_id = None

    def tokens_lost(self) -> None:
        """The worker its tokens were coming from is gone: none is in flight any more."""
        self.num_tokens_in_flight, self.in_flight_worker_id, self.in_flight_steps = 0, None, []

    def all_token_ids(self) -> tuple[int, ...]:
        return self.request.prompt_token_ids + tuple(self.output_token_ids)

    def add_prompt_logprobs(self, chunk: PromptLogprobs) -> None:
        """Keeps a chunk's prompt logprobs (a recomputed chunk replaces what it covers)."""
        if self.output_token_ids or chunk.first_position > len(self.prompt_logprobs) + 1:
            return  # reported already, or a gap (an earlier chunk was lost): keep what is consistent
        del self.prompt_logprobs[chunk.first_position - 1:]
        self.prompt_logprobs.extend(chunk.entries)

    def take_prompt_logprobs(self) -> tuple[TokenLogprobs, ...] | None:
        """The prompt logprobs to send with this sequence's first output (sample 0 of a request
        that asked for them, before its first token), then forgets them; None otherwise."""
        if self.output_token_ids or self.sample_index != 0 or self.sampling.prompt_logprobs is None:
            return None
        taken, self.prompt_logprobs = tuple(self.prompt_logprobs), []
        return taken

    def append_tokens(self, token_ids: list[int]) -> tuple[int, FinishReason | None]:
        """Appends ``token_ids`` in order until one finishes the sequence; returns how many were
        appended, and why the sequence is now finished, if it is."""
        for count, token_id in enumerate(token_ids, start=1):
            if (reason := self.append_token(token_id)) is not None:
                return count, reason
        return len(token_ids), None

    def append_token(self, token_id: int) -> FinishReason | None:
        """Adds a sampled token; returns why the sequence is now finished, if it is."""
        self.output_token_ids.append(token_id)
        sampling = self.sampling
        if sampling.stops_at(token_id, len(self.output_token_ids)):
            return FinishReason.STOP
        if len(self.output_token_ids) >= sampling.max_tokens:
            return FinishReason.LENGTH
        return None

    def __repr__(self) -> str:
        return (
            f"Sequence({self.seq_id}, {self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, worker={self.worker_id})"
        )
