"""Per-gateway queues of token-event batches between the scheduler loop and StreamOutputs calls."""

from __future__ import annotations

import queue
import threading

from services.common.pb import engine_pb2 as pb


class GatewayStreams:
    """The loop publishes batches for a gateway; that gateway's StreamOutputs call drains them.

    A gateway's queue exists from its first event or subscription until it is closed, so events
    produced while a gateway reconnects wait for it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queues: dict[str, queue.SimpleQueue[pb.TokenEventBatch]] = {}

    def queue_for(self, gateway_id: str) -> queue.SimpleQueue[pb.TokenEventBatch]:
        with self._lock:
            return self._queues.setdefault(gateway_id, queue.SimpleQueue())

    def publish(self, gateway_id: str, batch: pb.TokenEventBatch) -> None:
        self.queue_for(gateway_id).put(batch)

    def close(self, gateway_id: str) -> None:
        with self._lock:
            self._queues.pop(gateway_id, None)
