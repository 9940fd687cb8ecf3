"""Which gateways listen to this scheduler (their requests wait in the request table meanwhile)."""

from __future__ import annotations

import time
from collections.abc import Callable


class GatewayPresence:
    """Tracks each gateway's output stream: live, or gone since when (a gateway whose request was
    read before it ever connected counts as gone since then).

    Args:
        grace_s: how long a gateway may stay away before its requests are dropped, seconds.
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(self, grace_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._grace_s = grace_s
        self._clock = clock
        self._live: set[str] = set()
        self._gone: dict[str, float] = {}  # gateway id -> when its stream closed (or its first request was read)

    def is_live(self, gateway_id: str) -> bool:
        return gateway_id in self._live

    def back(self, gateway_id: str) -> None:
        """Marks a gateway's stream open."""
        self._live.add(gateway_id)
        self._gone.pop(gateway_id, None)

    def gone(self, gateway_id: str) -> None:
        """Marks a gateway's stream closed now."""
        self._live.discard(gateway_id)
        self._gone[gateway_id] = self._clock()

    def request_read(self, gateway_id: str) -> None:
        """A request of a gateway that is not listening was read: unless the gateway connects within
        the grace period, it counts as gone."""
        self._gone.setdefault(gateway_id, self._clock())

    def expired(self) -> list[str]:
        """Forgets and returns the gateways gone longer than the grace period."""
        deadline = self._clock() - self._grace_s
        expired = [g for g, since in self._gone.items() if since < deadline]
        for gateway_id in expired:
            del self._gone[gateway_id]
        return expired
