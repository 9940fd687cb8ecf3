"""Per-gateway queues of token-event batches between the scheduler loop and StreamOutputs calls."""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field

from pagedserve.services.common.pb import engine_pb2 as pb


@dataclass
class _Stream:
    generation: int
    events: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)


class GatewayStreams:
    """The loop publishes batches for a gateway; that gateway's newest StreamOutputs call drains them.

    A gateway's queue exists from its first event or subscription until it is closed, so events
    produced while a gateway reconnects wait for it. A new subscription under the same gateway id
    (a reconnect whose old stream is not yet known to be dead) takes over the queue and its
    pending events; the older call sees it is no longer current and ends, and its end does not
    count as the gateway going away. Resume queries are not carried over (a stale one would take a
    request from the scheduler that resumed it meanwhile): the loop sends those still waiting again.
    A gateway gone past its grace is retired (``retire``): its queue, which holds the final outputs
    of the requests dropped for it, is kept a while for a gateway that comes back just then.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._streams: dict[str, _Stream] = {}
        self._retiring: dict[str, float] = {}  # gateway id -> when its queue goes, unless it subscribes again
        self._generations = 0

    def subscribe(self, gateway_id: str) -> tuple[int, queue.SimpleQueue[pb.TokenEventBatch]]:
        """Makes a new current stream for ``gateway_id``; returns its generation and its queue."""
        with self._lock:
            self._generations += 1
            new = _Stream(self._generations)
            old = self._streams.get(gateway_id)
            while old is not None and not old.events.empty():
                batch = old.events.get_nowait()
                if batch.resume_queries:  # possibly withdrawn meanwhile: the loop sends the live ones again
                    batch = pb.TokenEventBatch(events=batch.events)  # on the new stream (GatewayBack)
                if batch.events:
                    new.events.put(batch)
            self._streams[gateway_id] = new
            self._retiring.pop(gateway_id, None)
            return new.generation, new.events

    def is_current(self, gateway_id: str, generation: int) -> bool:
        """Whether the subscription ``generation`` is still the gateway's current stream."""
        with self._lock:
            stream = self._streams.get(gateway_id)
            return stream is not None and stream.generation == generation

    def publish(self, gateway_id: str, batch: pb.TokenEventBatch) -> None:
        with self._lock:  # held while putting: a subscription moving the queue's events must not miss it
            stream = self._streams.get(gateway_id)
            if stream is None:  # no subscription yet: the events wait for one
                stream = self._streams[gateway_id] = _Stream(0)
            stream.events.put(batch)

    def retire(self, gateway_id: str, until_s: float) -> None:
        """Drops the gateway's queue at ``until_s`` (``time.monotonic()`` seconds) unless it subscribes
        again before: the final outputs of the requests dropped at the end of its grace period still
        reach a gateway that reconnects then (its own grace runs on its own clock)."""
        with self._lock:
            if gateway_id in self._streams:
                self._retiring[gateway_id] = until_s

    def keep(self, gateway_id: str) -> None:
        """Cancels the gateway's retirement: it listens again (its subscription may predate ``retire``)."""
        with self._lock:
            self._retiring.pop(gateway_id, None)

    def drop_retired(self, now_s: float) -> None:
        """Drops the queues of gateways retired until ``now_s`` or before."""
        with self._lock:
            for gateway_id in [g for g, until_s in self._retiring.items() if until_s <= now_s]:
                del self._retiring[gateway_id]
                self._streams.pop(gateway_id, None)
