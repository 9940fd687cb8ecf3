"""Balancing new requests across schedulers by load (issue #20: a burst of 100 requests split 96/4).

Every scheduler publishes its load (requests waiting plus sequences running) with its registration
each tick (``ClusterWatch.peer_loads``). A scheduler that reads a new request forwards it to the
least-loaded peer that runs a worker when its own load exceeds that peer's by more than
``BALANCE_SLACK``, as the power-of-choices dispatchers of web load balancers compare queue lengths
(Mitzenmacher, "The Power of Two Choices in Randomized Load Balancing", 2001), here over every
peer since there are few. Between two registrations a peer's published load is stale: the
requests forwarded to it since are added to it, so a burst read in one go does not all go to one
peer either. Prefix-aware forwarding (``prefix_index``) considers only the peers whose estimated
load stays within ``BALANCE_SLACK`` of this scheduler's: a cached prefix never draws a burst onto one
scheduler.
"""

from __future__ import annotations

from collections.abc import Mapping

BALANCE_SLACK = 2
"""A new request moves to a peer only when this scheduler's load exceeds the peer's by more than
this (requests): equal schedulers never trade requests back and forth."""


class PeerLoads:
    """The peers' loads as published, plus what this scheduler forwarded to each since."""

    def __init__(self) -> None:
        self._published: Mapping[str, int] = {}
        self._forwarded: dict[str, int] = {}

    def estimates(self, published: Mapping[str, int]) -> dict[str, int]:
        """Each peer's load as published plus the requests forwarded to it since.

        Args:
            published: peer id -> load as last published (``ClusterWatch.peer_loads``; a new
                mapping at every registration read, which resets the forwarded counts).
        """
        if published is not self._published:
            self._published, self._forwarded = published, {}
        return {peer: load + self._forwarded.get(peer, 0) for peer, load in published.items()}

    def lighter_peer(self, published: Mapping[str, int], own_load: int) -> str | None:
        """The least-loaded peer (ties by id) if ``own_load`` (waiting plus running, including the
        request to place) exceeds its estimated load by more than ``BALANCE_SLACK``; None: keep
        the request."""
        loads = self.estimates(published)
        if not loads:
            return None
        peer = min(loads, key=lambda p: (loads[p], p))
        return peer if own_load - loads[peer] > BALANCE_SLACK else None

    def forwarded(self, peer: str) -> None:
        """Counts a request forwarded to ``peer`` (for any reason) into its estimate."""
        self._forwarded[peer] = self._forwarded.get(peer, 0) + 1
