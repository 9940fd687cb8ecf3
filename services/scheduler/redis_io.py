"""The scheduler's Redis I/O that runs beside the loop, on threads of its own, so that the loop thread
never waits on Redis (a Redis that hangs stalls no token)."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from services.scheduler.worker_registry import WorkerRegistry

log = logging.getLogger("pagedserve.scheduler")


class Acknowledger:
    """Acknowledges finished requests' stream entries, in the order they are put.

    An entry that cannot be acknowledged (Redis down) stays pending: a restarted scheduler reads it
    again, and the gateway, which no longer waits for it, aborts it.

    Args:
        ack: acknowledges one entry (``RequestQueueConsumer.ack``); may raise Redis errors.
    """

    def __init__(self, ack: Callable[[bytes], None]) -> None:
        self._ack = ack
        self._entries: queue.SimpleQueue[bytes] = queue.SimpleQueue()

    def put(self, entry_id: bytes) -> None:
        """Queues an entry to acknowledge (thread-safe, never blocks)."""
        self._entries.put(entry_id)

    def run(self, stop: threading.Event) -> None:
        """Acknowledges queued entries until ``stop`` is set."""
        while not stop.is_set():
            try:
                entry_id = self._entries.get(timeout=0.2)
            except queue.Empty:
                continue
            try:
                self._ack(entry_id)
            except Exception as exc:
                log.warning("could not acknowledge %r: %s", entry_id, exc)


def watch_registrations(registry: WorkerRegistry, publish: Callable, interval_s: float, stop: threading.Event) -> None:
    """Reads the worker registrations every ``interval_s`` seconds and passes them to ``publish``
    until ``stop`` is set; while Redis is down nothing is published (the workers stay as they are)."""
    while not stop.wait(interval_s):
        try:
            publish(registry.live_workers())
        except Exception as exc:
            log.warning("cannot read worker registrations: %s", exc)
