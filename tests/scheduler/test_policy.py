"""The policies' waiting queues: ``first`` (the head and the prompts behind it that may pass it,
``admission_order``), and removed entries dropped from the priority heap."""

from __future__ import annotations

import pytest

from pagedserve.engine.messages import EngineRequest
from pagedserve.engine.policy import FCFS, PRIORITY
from pagedserve.engine.sampling_params import EngineSamplingParams
from pagedserve.engine.sequence import Sequence


def seq(rid: str, t: float, priority: int = 0) -> Sequence:
    return Sequence(EngineRequest(rid, (1, 2, 3), EngineSamplingParams(max_tokens=1), t, priority=priority))


@pytest.mark.parametrize("policy, expected", [(FCFS, ["c", "a", "d"]), (PRIORITY, ["c", "d", "a"])])
def test_first_lists_the_queue_in_its_order_without_removed_sequences(policy, expected):
    queue = policy.make_queue()
    a, b, c, d = seq("a", 1.0, priority=5), seq("b", 2.0), seq("c", 0.5), seq("d", 3.0)
    for s in (a, b, d):
        queue.push(s)
    queue.push_preempted(c)
    queue.remove(b.seq_id)
    assert [s.request.request_id for s in queue.first(10)] == expected
    assert [s.request.request_id for s in queue.first(2)] == expected[:2]
    assert queue.first(0) == []


def test_first_of_a_large_priority_queue_is_its_smallest_entries_in_order():
    import random

    rng = random.Random(5)
    queue = PRIORITY.make_queue()
    sequences = [seq(f"r{i}", rng.random(), priority=rng.randrange(4)) for i in range(500)]
    for s in sequences:
        queue.push(s)
    for s in sequences[::3]:
        queue.remove(s.seq_id)
    live = [s for i, s in enumerate(sequences) if i % 3]
    expected = sorted(live, key=lambda s: (s.request.priority, s.request.arrival_time))[:40]
    assert queue.first(40) == expected
    assert queue.first(40)[0] is queue.peek()


def test_removed_entries_do_not_pile_up_in_the_priority_heap():
    queue = PRIORITY.make_queue()
    head = seq("head", 0.0)
    queue.push(head)
    for i in range(1000):  # prompts admitted from behind a head that stays: never popped at the root
        passer = seq(f"p{i}", 1.0 + i)
        queue.push(passer)
        queue.remove(passer.seq_id)
    assert len(queue._heap) <= 2 * len(queue) + 64 and queue.first(5) == [head] and queue.peek() is head
