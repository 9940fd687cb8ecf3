"""Scheduling policies: the order of the waiting queue, and whom to preempt.

``FCFS``: first come, first served; the newest running sequence is preempted first.
``PRIORITY``: lower ``priority`` values run first (ties by arrival); the running sequence with the
highest priority value, latest arrived, is preempted first (vLLM's priority policy).
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

from pagedserve.engine.config import SchedulingPolicy
from pagedserve.engine.messages import SequenceId
from pagedserve.engine.sequence import Sequence


class WaitingQueue(Protocol):
    """The queue of sequences waiting to be admitted. Removal by id is O(1) or amortized O(log n)."""

    def push(self, seq: Sequence) -> None:
        """Adds a newly arrived sequence."""

    def push_preempted(self, seq: Sequence) -> None:
        """Puts back a preempted sequence, ahead of later arrivals."""

    def peek(self) -> Sequence:
        """The sequence to admit next. Raises IndexError when empty."""

    def first(self, count: int) -> list[Sequence]:
        """The first ``count`` sequences (fewer if fewer wait), in order."""

    def remove(self, seq_id: SequenceId) -> None:
        """Drops a sequence (aborted or admitted); unknown ids are ignored."""

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[Sequence]: ...


class FcfsQueue:
    """Arrival order; preempted sequences go back to the front."""

    def __init__(self) -> None:
        self._queue: OrderedDict[SequenceId, Sequence] = OrderedDict()

    def push(self, seq: Sequence) -> None:
        self._queue[seq.seq_id] = seq

    def push_preempted(self, seq: Sequence) -> None:
        self._queue[seq.seq_id] = seq
        self._queue.move_to_end(seq.seq_id, last=False)

    def peek(self) -> Sequence:
        if not self._queue:
            raise IndexError("the waiting queue is empty")
        return next(iter(self._queue.values()))

    def first(self, count: int) -> list[Sequence]:
        return list(itertools.islice(self._queue.values(), count))

    def remove(self, seq_id: SequenceId) -> None:
        self._queue.pop(seq_id, None)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Sequence]:
        return iter(list(self._queue.values()))


class PriorityQueue:
    """Lowest ``(priority, arrival_time)`` first; a heap with lazy deletion of removed entries."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Sequence]] = []
        self._live: dict[SequenceId, int] = {}  # sequence -> tie-break number of its live heap entry
        self._counter = itertools.count()

    def push(self, seq: Sequence) -> None:
        number = next(self._counter)
        self._live[seq.seq_id] = number
        heapq.heappush(self._heap, (seq.request.priority, seq.request.arrival_time, number, seq))

    def push_preempted(self, seq: Sequence) -> None:
        self.push(seq)  # its priority and arrival time already put it ahead of later arrivals

    def _drop_dead(self) -> None:
        while self._heap and self._live.get(self._heap[0][3].seq_id) != self._heap[0][2]:
            heapq.heappop(self._heap)

    def peek(self) -> Sequence:
        self._drop_dead()
        if not self._heap:
            raise IndexError("the waiting queue is empty")
        return self._heap[0][3]

    def first(self, count: int) -> list[Sequence]:
        # the smallest entries of a heap are found from its root down: O(m log m) for the m entries looked at,
        # removed ones among them (at most about half the heap: ``remove``)
        found: list[Sequence] = []
        frontier = [(self._heap[0], 0)] if self._heap else []
        while frontier and len(found) < count:
            entry, i = heapq.heappop(frontier)
            if self._live.get(entry[3].seq_id) == entry[2]:
                found.append(entry[3])
            for child in (2 * i + 1, 2 * i + 2):
                if child < len(self._heap):
                    heapq.heappush(frontier, (self._heap[child], child))
        return found

    def remove(self, seq_id: SequenceId) -> None:
        self._live.pop(seq_id, None)
        if len(self._heap) > 2 * len(self._live) + 64:  # removed entries are dropped once they are half of it
            self._heap = [entry for entry in self._heap if self._live.get(entry[3].seq_id) == entry[2]]
            heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[Sequence]:
        return iter([entry[3] for entry in sorted(self._heap) if self._live.get(entry[3].seq_id) == entry[2]])


def admission_order(running: OrderedDict[SequenceId, Sequence]) -> list[Sequence]:
    """FCFS: running sequences in the order they were admitted."""
    return list(running.values())


def priority_order(running: OrderedDict[SequenceId, Sequence]) -> list[Sequence]:
    """Priority: lowest ``(priority, arrival_time)`` first."""
    return sorted(running.values(), key=lambda s: (s.request.priority, s.request.arrival_time))


@dataclass(frozen=True)
class Policy:
    """A waiting-queue order and a running order that belong together.

    Running sequences are served in ``running_order``; when blocks run out, the last of that
    order not yet served is preempted, so the victim is the newest (FCFS) or the lowest-priority,
    latest-arrived (priority) sequence, and never one already served in the iteration.
    ``precedence``: the class a sequence is served in, lower first (all alike under FCFS; the
    request's priority under priority): a shorter prompt may take prefill room from a longer one of
    its class or a later one, never from an earlier one (``RunningSchedule._prefill_share``).
    """

    name: SchedulingPolicy
    make_queue: Callable[[], WaitingQueue]
    running_order: Callable[[OrderedDict[SequenceId, Sequence]], list[Sequence]]
    precedence: Callable[[Sequence], int]


FCFS = Policy(SchedulingPolicy.FCFS, FcfsQueue, admission_order, lambda seq: 0)
PRIORITY = Policy(SchedulingPolicy.PRIORITY, PriorityQueue, priority_order, lambda seq: seq.request.priority)
POLICIES = {policy.name: policy for policy in (FCFS, PRIORITY)}
