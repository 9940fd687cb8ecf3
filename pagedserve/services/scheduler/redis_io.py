"""The scheduler loop's writes to Redis, made on a thread of their own so that the loop thread never
waits on Redis (a Redis that hangs stalls no token)."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

import redis

from pagedserve.services.scheduler.queue_consumer import QueueEntry

log = logging.getLogger("pagedserve.scheduler")

RETRY_AFTER_S = 1.0
"""Wait before a write that failed on a Redis error is made again, seconds."""


@dataclass(frozen=True)
class _Ack:
    entry_id: bytes


@dataclass(frozen=True)
class _HandOff:
    entries: tuple[QueueEntry, ...]


class RedisWrites:
    """Acknowledges finished requests' stream entries and hands requests off, in the order asked.

    A write that fails on a Redis error is made again (after the others queued meanwhile) until it
    succeeds or the scheduler stops: an entry not acknowledged would stay in Redis, and requests not
    handed off would wait for ever (nobody runs them, and this scheduler's lease keeps peers off).
    An entry left pending at a stop is taken again by a restarted scheduler (or a peer), which asks
    its gateway whether to resume it.

    Args:
        ack: acknowledges one entry (``RequestQueueConsumer.ack``); may raise Redis errors.
        hand_off: moves entries to the hand-off consumer, or queues again those Redis forgot
            (``Leases.hand_off``, returns how many); may raise Redis errors.
    """

    def __init__(self, ack: Callable[[bytes], None], hand_off: Callable[[list[QueueEntry]], int]) -> None:
        self._ack = ack
        self._hand_off = hand_off
        self._writes: queue.SimpleQueue[_Ack | _HandOff] = queue.SimpleQueue()

    def ack(self, entry_id: bytes) -> None:
        """Queues an entry to acknowledge (thread-safe, never blocks)."""
        self._writes.put(_Ack(entry_id))

    def hand_off(self, entries: list[QueueEntry]) -> None:
        """Queues requests to hand to the peers (thread-safe, never blocks)."""
        self._writes.put(_HandOff(tuple(entries)))

    def run(self, stop: threading.Event) -> None:
        """Makes the queued writes until ``stop`` is set."""
        while not stop.is_set():
            try:
                write = self._writes.get(timeout=0.2)
            except queue.Empty:
                continue
            try:
                if isinstance(write, _Ack):
                    self._ack(write.entry_id)
                elif requeued := self._hand_off(list(write.entries)):
                    log.warning("%d of %d request(s) handed off had no entry in Redis any more (it restarted "
                                "empty): queued again, to be resumed by a peer", requeued, len(write.entries))
            except redis.RedisError as exc:  # made again: a hand-off lost here would strand its requests
                log.warning("Redis write failed (%s): %s; retrying in %g s", write, exc, RETRY_AFTER_S)
                self._writes.put(write)
                stop.wait(RETRY_AFTER_S)
            except Exception as exc:
                log.warning("Redis write failed (%s): %s", write, exc)
