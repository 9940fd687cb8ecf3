"""Which gateways listen to this scheduler, and the requests read for gateways that do not (yet)."""

from __future__ import annotations

import time
from collections.abc import Callable

from services.scheduler.queue_consumer import QueueEntry


class GatewayPresence:
    """Tracks each gateway's output stream: live, or gone since when; parks requests of gateways
    that are not listening, so that nothing runs for a client nobody would stream to.

    Args:
        grace_s: how long a gateway may stay away before its requests are dropped, seconds.
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(self, grace_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._grace_s = grace_s
        self._clock = clock
        self._live: set[str] = set()
        self._gone: dict[str, float] = {}  # gateway id -> when its stream closed (or its first request was read)
        self._parked: dict[str, dict[str, QueueEntry]] = {}  # gateway id -> request id -> entry

    def is_live(self, gateway_id: str) -> bool:
        return gateway_id in self._live

    def back(self, gateway_id: str) -> list[QueueEntry]:
        """Marks a gateway's stream open; returns the entries parked for it (to be added now)."""
        self._live.add(gateway_id)
        self._gone.pop(gateway_id, None)
        return list(self._parked.pop(gateway_id, {}).values())

    def gone(self, gateway_id: str) -> None:
        """Marks a gateway's stream closed now."""
        self._live.discard(gateway_id)
        self._gone[gateway_id] = self._clock()

    def park(self, entry: QueueEntry) -> None:
        """Keeps the entry of a gateway that is not listening; it is dropped unless the gateway
        connects within the grace period."""
        gateway_id = entry.request.gateway_id
        self._gone.setdefault(gateway_id, self._clock())
        self._parked.setdefault(gateway_id, {})[entry.request.request_id] = entry

    def expired(self) -> dict[str, list[QueueEntry]]:
        """Forgets the gateways gone longer than the grace period; returns each one's parked entries."""
        deadline = self._clock() - self._grace_s
        expired = [g for g, since in self._gone.items() if since < deadline]
        for gateway_id in expired:
            del self._gone[gateway_id]
        return {g: list(self._parked.pop(g, {}).values()) for g in expired}

    def take_all_parked(self) -> list[QueueEntry]:
        """Removes and returns every parked entry (they are handed off)."""
        entries = [e for parked in self._parked.values() for e in parked.values()]
        self._parked.clear()
        return entries
