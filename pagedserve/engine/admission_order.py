"""Which waiting prompt admission takes next: the queue's head, or a shorter prompt behind a head that
waits for an earlier prompt's chunks anyway.

With chunked prefill a long prompt is prefilled over many steps. The short-prompt share
(``RunningSchedule._prefill_share``) lets a shorter prompt take part of each step's room from it; but
admission is in the policy's order, so when a second long prompt heads the queue, a short prompt queued
behind it waits for the whole first prefill, then for the second's admission, although the second would
not have taken any of that room. vLLM's chunked prefill answers the same case with a cap on the long
prompts prefilled at once, letting "shorter prompts jump the queue in front of longer prompts"
(``max_long_partial_prefills``); here the rule is relative and needs no length threshold:

* the head **waits behind** a worker when it is placed there and a prompt that arrived before it
  (``Sequence.arrival_order``: this scheduler's order, not the front ends' clocks) is being prefilled there:
  it will not be admitted before that one's chunks leave room;
* then the first waiting prompt within ``PASSING_WINDOW`` places of the head that is shorter than the
  head, of the head's precedence, not a fork and with no token in flight, **passes** it, if it is placed
  on the same worker; the admission loop asks again after each admission, so several may pass in a step.

A fork (a sample of ``n > 1`` that takes one token beside its parent) and a sequence with tokens in flight
are never passed. Starvation-free: the head is passed only while prompts that arrived before it are
prefilled, a set that only shrinks (a higher-priority prompt arriving later lets nothing pass it); once
their chunks are done it is admitted before anything behind it. Without a short-prompt share
(``short_prompt_share`` 0) the head is never passed.
"""

from __future__ import annotations

from typing import NamedTuple

from pagedserve.engine.policy import Policy, WaitingQueue
from pagedserve.engine.sequence import Sequence
from pagedserve.engine.worker_pool import WorkerPool
from pagedserve.engine.worker_state import PlanDraft, WorkerState

PASSING_WINDOW = 64
"""How far behind the head the waiting queue is searched for a shorter prompt that may pass it."""


class NextAdmission(NamedTuple):
    """The waiting sequence to admit next and the worker it is placed on (None: it cannot be placed now)."""

    seq: Sequence
    worker: WorkerState | None


def queue_head(waiting: WaitingQueue, policy: Policy, workers: WorkerPool,
               drafts: dict[str, PlanDraft]) -> NextAdmission:
    """The head of the non-empty ``waiting`` queue and the worker ``WorkerPool.place`` puts it on among
    ``drafts``' workers: first come, first served (``short_prompt_share`` 0)."""
    head = waiting.peek()
    return NextAdmission(head, workers.place(head, drafts))


def passing_head(waiting: WaitingQueue, policy: Policy, workers: WorkerPool,
                 drafts: dict[str, PlanDraft]) -> NextAdmission:
    """As :func:`queue_head`, or the shorter prompt that passes the head (module docstring)."""
    head = queue_head(waiting, policy, workers, drafts)
    if head.worker is None or head.seq.fork_parent is not None or head.seq.num_tokens_in_flight:
        return head
    rank = policy.precedence(head.seq)
    passer = next((seq for seq in waiting.first(PASSING_WINDOW + 1)[1:]
                   if seq.num_tokens < head.seq.num_tokens and policy.precedence(seq) == rank
                   and seq.fork_parent is None and not seq.num_tokens_in_flight), None)
    # the scan of the worker's running sequences only when a prompt could pass
    if passer is None or not _waits_behind(head.seq, head.worker) or workers.place(passer, drafts) is not head.worker:
        return head
    return NextAdmission(passer, head.worker)


def _waits_behind(head: Sequence, worker: WorkerState) -> bool:
    """Whether a prompt that arrived before ``head`` is being prefilled on ``worker``."""
    return any(s.num_uncomputed_tokens > 1 and s.arrival_order < head.arrival_order for s in worker.running.values())
