"""The requests one scheduler holds: a sequence per sample, the queue of those waiting to be
admitted, and the samples of parallel sampling (``parallel_sampling.Forks``)."""

from __future__ import annotations

import logging

from collections.abc import Sequence as Seq

from pagedserve.engine.messages import EngineRequest, FinishReason, ResumedSample, SequenceId
from pagedserve.engine.parallel_sampling import Forks
from pagedserve.engine.policy import Policy
from pagedserve.engine.request_resume import check_resumed, resumed_sequences, starts_fresh
from pagedserve.engine.sequence import Sequence, SequenceStatus
from pagedserve.engine.worker_state import PlanDraft, WorkerState

log = logging.getLogger("pagedserve.scheduler")


class RequestsInFlight:
    """Every unfinished sequence by id, and the waiting ones in ``policy``'s order.

    Knows nothing of blocks: whoever requeues or finishes a sequence here frees its blocks first.

    Attributes:
        sequences: the unfinished sequences (read only: change them through the methods).
        waiting: the sequences waiting to be admitted, in the policy's order.
    """

    def __init__(self, policy: Policy) -> None:
        self.sequences: dict[SequenceId, Sequence] = {}
        self.waiting = policy.make_queue()
        self.held: dict[str, None] = {}  # ids of the requests held for their grammar, oldest first
        self._forks = Forks()

    def add(self, request: EngineRequest) -> None:
        """Queues a request.

        Raises:
            ValueError: a request with this id is already in flight.
        """
        if self.has_request(request.request_id):
            raise ValueError(f"request {request.request_id!r} is already in flight")
        seq = Sequence(request)
        self.sequences[seq.seq_id] = seq
        self.waiting.push(seq)

    def resume(self, request: EngineRequest, resumed: Seq[ResumedSample]) -> None:
        """Takes over a request another scheduler ran, continuing from the tokens already delivered
        (request migration, as NVIDIA Dynamo's): ``resumed`` lists them per sample; finished samples
        do not run again, the others wait like recompute-preempted ones (see ``request_resume``).

        Raises:
            ValueError: the request is in flight, or ``resumed`` does not fit it; nothing changes then.
        """
        if self.has_request(request.request_id):
            raise ValueError(f"request_id: request {request.request_id!r} is already in flight")
        check_resumed(request, resumed)
        if starts_fresh(resumed):
            return self.add(request)
        sequences = resumed_sequences(request, resumed)
        for seq in reversed(sequences):  # each goes to the front: sample 0 ends up first
            self.sequences[seq.seq_id] = seq
            self.waiting.push_preempted(seq)
        self._forks.adopt(request, sequences)

    def hold(self, request_id: str) -> None:
        """Takes the request's waiting samples out of the queue until :meth:`release` (their
        grammar is being built); their status says so."""
        for seq_id in self.sample_ids(request_id):
            seq = self.sequences.get(seq_id)
            if seq is not None and seq.status is SequenceStatus.WAITING:
                self.waiting.remove(seq_id)
                seq.status = SequenceStatus.WAITING_FOR_GRAMMAR
                self.held[request_id] = None

    def release(self, request_id: str) -> None:
        """Queues the samples :meth:`hold` took out (behind later arrivals when they have no
        output yet; ahead of them, like preempted ones, when they do: a resumed request)."""
        self.held.pop(request_id, None)
        held = [self.sequences[i] for i in self.sample_ids(request_id)
                if i in self.sequences and self.sequences[i].status is SequenceStatus.WAITING_FOR_GRAMMAR]
        for seq in held:
            seq.status = SequenceStatus.WAITING
        for seq in reversed([s for s in held if s.num_output_tokens]):  # sample 0 ends up first
            self.waiting.push_preempted(seq)
        for seq in [s for s in held if not s.num_output_tokens]:
            self.waiting.push(seq)

    def has_request(self, request_id: str) -> bool:
        """Whether any sample of request ``request_id`` is still in flight."""
        return SequenceId(request_id, 0) in self.sequences or self._forks.knows(request_id)

    def sample_ids(self, request_id: str) -> list[SequenceId]:
        """The ids of the request's live samples (sample 0's alone for ``n = 1``, in flight or not)."""
        return self._forks.sequence_ids(request_id) or [SequenceId(request_id, 0)]

    def forget(self, request_id: str) -> None:
        """Drops the request's group of samples (once all of them are finished)."""
        self._forks.forget(request_id)

    def waiting_requests(self) -> list[str]:
        """Ids of the requests with a sample waiting to be admitted, in queue order, then those held
        for their grammar."""
        return list(dict.fromkeys([*(seq.request_id for seq in self.waiting), *self.held]))

    @property
    def num_waiting(self) -> int:
        """Sequences in the queue, and requests held for their grammar."""
        return len(self.waiting) + len(self.held)

    def add_child(self, parent: Sequence, sample_index: int) -> Sequence:
        """Sample ``sample_index`` of ``parent``'s request, queued ahead of later arrivals."""
        return self._forks.add_child(parent, sample_index, self.sequences, self.waiting)

    def try_fork(self, seq: Sequence, worker: WorkerState, draft: PlanDraft) -> bool:
        """``Forks.try_fork``: ``seq`` shares its parent's prompt blocks on ``worker`` if it can."""
        return self._forks.try_fork(seq, worker, draft, self.sequences)

    def tokens_lost_on(self, worker_id: str) -> None:
        """The tokens in flight on a worker that is gone will not come (``Sequence.tokens_lost``)."""
        for seq in self.sequences.values():
            if seq.in_flight_worker_id == worker_id:
                seq.tokens_lost()

    def missing_from_answer(self, worker_id: str, step_id: int, sampling: Seq[Sequence]) -> list[Sequence]:
        """The sequences of ``sampling`` (a step's, ``PlanDraft.sampling``) still in flight and
        waiting for a token of that step, whose answer is applied: none will come (a scheduler bug,
        logged as an error)."""
        lost = [seq for seq in sampling if seq.expects(worker_id, step_id) and self.sequences.get(seq.seq_id) is seq]
        for seq in lost:
            log.error("step %d of %s was answered without the token of %s (a scheduler bug): it ends with an error",
                      step_id, worker_id, seq.seq_id)
        return lost

    def requeue(self, seq: Sequence) -> None:
        """Recompute preemption (its blocks already freed): ``seq`` waits ahead of later arrivals."""
        seq.status, seq.worker_id, seq.num_computed_tokens = SequenceStatus.WAITING, None, 0
        self.waiting.push_preempted(seq)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Marks ``seq`` finished (its blocks already freed) and forgets it."""
        self.waiting.remove(seq.seq_id)
        seq.status, seq.finish_reason, seq.worker_id = SequenceStatus.FINISHED, reason, None
        del self.sequences[seq.seq_id]
        self._forks.finished(seq)
        if seq.request_id in self.held and not any(
                self.sequences[i].status is SequenceStatus.WAITING_FOR_GRAMMAR
                for i in self.sample_ids(seq.request_id) if i in self.sequences):
            del self.held[seq.request_id]
