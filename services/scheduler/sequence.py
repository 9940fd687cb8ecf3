"""A request's state inside the scheduler: its tokens, how many are computed, where it runs."""

from __future__ import annotations

import enum

from services.common.messages import EngineRequest, FinishReason


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and queued again; holds no blocks
    RUNNING = "running"  # placed on a worker, holds blocks there
    FINISHED = "finished"


class Sequence:
    """Mutable scheduling state of one request. Only the scheduler changes it.

    Attributes:
        request: the immutable request as it arrived.
        output_token_ids: tokens generated so far.
        num_computed_tokens: tokens (of prompt + output) whose K/V are in the worker's cache,
            counting the tokens scheduled in the current iteration.
        worker_id: the worker holding its blocks while running; ``None`` otherwise.
        num_preemptions: how often its blocks were taken back.
    """

    __slots__ = (
        "request",
        "output_token_ids",
        "status",
        "num_computed_tokens",
        "worker_id",
        "finish_reason",
        "num_preemptions",
    )

    def __init__(self, request: EngineRequest) -> None:
        self.request = request
        self.output_token_ids: list[int] = []
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.worker_id: str | None = None
        self.finish_reason: FinishReason | None = None
        self.num_preemptions = 0

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens."""
        return self.num_prompt_tokens + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still to compute: the rest of the prompt (or all after preemption), else 1."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def max_slots(self) -> int:
        """Slots the sequence can ever need: the last sampled token is never fed back."""
        return self.num_prompt_tokens + self.request.sampling.max_tokens - 1

    def all_token_ids(self) -> tuple[int, ...]:
        return self.request.prompt_token_ids + tuple(self.output_token_ids)

    def append_token(self, token_id: int) -> FinishReason | None:
        """Adds a sampled token; returns why the sequence is now finished, if it is."""
        self.output_token_ids.append(token_id)
        sampling = self.request.sampling
        if sampling.stops_at(token_id, len(self.output_token_ids)):
            return FinishReason.STOP
        if len(self.output_token_ids) >= sampling.max_tokens:
            return FinishReason.LENGTH
        return None

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, worker={self.worker_id})"
        )
