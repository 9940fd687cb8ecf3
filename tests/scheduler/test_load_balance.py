"""New requests balanced across schedulers by load (issue #20, defect 6)."""

from __future__ import annotations

from pagedserve.services.scheduler.load_balance import BALANCE_SLACK, PeerLoads


def test_a_request_moves_only_when_this_scheduler_is_heavier_by_more_than_the_slack():
    loads = PeerLoads()
    published = {"s1": 5}
    assert loads.lighter_peer(published, 5 + BALANCE_SLACK) is None
    assert loads.lighter_peer(published, 5 + BALANCE_SLACK + 1) == "s1"


def test_the_least_loaded_peer_is_chosen_ties_by_id():
    assert PeerLoads().lighter_peer({"s2": 0, "s1": 0, "s3": 4}, 10) == "s1"
    assert PeerLoads().lighter_peer({}, 100) is None


def test_a_burst_read_in_one_go_is_spread_by_what_was_forwarded_since_the_last_registration():
    """A reader that took 40 requests at once while its peers published loads of 0 and 10: it
    forwards each to the lighter peer while its own load exceeds that peer's by more than the
    slack; all three end within the slack of each other (18 kept; 16 and 10 + 6)."""
    loads, published = PeerLoads(), {"s1": 0, "s2": 10}
    kept, sent = 0, {"s1": 0, "s2": 0}
    for _ in range(40):
        peer = loads.lighter_peer(published, kept + 1)
        if peer is None:
            kept += 1
        else:
            loads.forwarded(peer)
            sent[peer] += 1
    assert (kept, sent) == (18, {"s1": 16, "s2": 6})
    newer = {"s1": 13, "s2": 21}
    assert loads.lighter_peer(newer, 16) == "s1"  # newer registrations: the counts start over
    loads.forwarded("s1")
    assert loads.estimates(newer) == {"s1": 14, "s2": 21} and loads.lighter_peer(newer, 16) is None
