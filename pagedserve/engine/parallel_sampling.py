"""Parallel sampling (``n > 1``): one prompt, ``n`` samples sharing its KV blocks.

The request runs as one sequence until its prompt is computed; the worker then samples ``n``
tokens from the prompt's logits. Sample 0 continues as the request's own sequence; samples
1..n-1 become child sequences, each with its own seed stream. A child is forked from its parent
on the parent's worker: it shares the prompt's blocks by reference count and gets a copy of the
partly filled last prompt block before anyone writes into it (copy-on-write; PagedAttention,
Kwon et al., SOSP 2023, §4.4). A child whose parent no longer runs is prefilled like any request
(prefix caching still shares the prompt's full blocks).
"""

from __future__ import annotations

from pagedserve.engine.messages import EngineRequest, SequenceId
from pagedserve.engine.sampling_params import child_sampling
from pagedserve.engine.sequence import Sequence, SequenceStatus
from pagedserve.engine.worker_state import PlanDraft, WorkerState


class Forks:
    """The live samples of every request with ``n > 1``, by request id."""

    def __init__(self) -> None:
        self._groups: dict[str, list[SequenceId]] = {}  # request id -> its live sequences

    def knows(self, request_id: str) -> bool:
        return request_id in self._groups

    def sequence_ids(self, request_id: str) -> list[SequenceId]:
        return list(self._groups.get(request_id, ()))

    def add_child(self, parent: Sequence, sample_index: int, sequences: dict[SequenceId, Sequence], waiting) -> Sequence:
        """Creates sample ``sample_index`` of ``parent``'s request, queued ahead of later arrivals."""
        child = Sequence(parent.request, sample_index, child_sampling(parent.request.sampling, sample_index))
        child.fork_parent = parent
        sequences[child.seq_id] = child
        group = self._groups.setdefault(parent.request_id, [parent.seq_id])
        group.append(child.seq_id)
        waiting.push_preempted(child)
        return child

    def adopt(self, request: EngineRequest, samples: list[Sequence]) -> None:
        """Makes ``samples`` the live samples of ``request`` (one with ``n > 1`` resumed sample by
        sample, ``request_resume``); nothing for ``n = 1`` or no sample."""
        if request.sampling.n > 1 and samples:
            self._groups[request.request_id] = [seq.seq_id for seq in samples]

    def try_fork(self, seq: Sequence, worker: WorkerState, draft: PlanDraft,
                 sequences: dict[SequenceId, Sequence]) -> bool:
        """Places a waiting child on its parent's worker by sharing the prompt's blocks.

        On success the child holds the prompt's blocks (its own copy of a partial last one, the
        copy listed in ``draft.copies``) and room for its first token, and counts the prompt as
        computed. False (nothing changed) when ``seq`` is no child, its parent is gone or runs
        elsewhere, or no block is free for the copy.
        """
        parent = seq.fork_parent
        seq.fork_parent = None  # one chance: afterwards the child runs as a plain sequence
        blocks = worker.blocks
        prompt_len = seq.num_prompt_tokens
        if (parent is None or parent.status is not SequenceStatus.RUNNING or parent.worker_id != worker.worker_id
                or sequences.get(parent.seq_id) is not parent or blocks.num_free_blocks < 1
                or seq.num_tokens != prompt_len + 1):
            return False
        computed_before_this_step = parent.num_computed_tokens - draft.scheduled.get(parent.seq_id, 0)
        if computed_before_this_step < prompt_len:
            return False  # the parent is recomputing its prompt in this very step: nothing to share yet
        blocks.fork(parent.seq_id, seq.seq_id, prompt_len)
        draft.copies.extend(blocks.copy_on_write(seq.seq_id, prompt_len))
        blocks.allocate_slots(seq.seq_id, prompt_len + 1)
        seq.num_computed_tokens = prompt_len
        return True

    def finished(self, seq: Sequence) -> None:
        group = self._groups.get(seq.request_id)
        if group is not None and seq.seq_id in group:
            group.remove(seq.seq_id)
            if not group:
                del self._groups[seq.request_id]

    def forget(self, request_id: str) -> None:
        self._groups.pop(request_id, None)

