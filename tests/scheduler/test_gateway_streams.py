"""GatewayStreams: the newest subscription of a gateway id is the current one and takes its events."""

from __future__ import annotations

from services.common.pb import engine_pb2 as pb
from services.scheduler.gateway_streams import GatewayStreams


def batch(n: int) -> pb.TokenEventBatch:
    return pb.TokenEventBatch(events=[pb.TokenEvent(request_id=f"r{n}")])


def test_a_newer_subscription_replaces_the_older_and_takes_pending_events():
    streams = GatewayStreams()
    first, old = streams.subscribe("g")
    streams.publish("g", batch(1))
    second, new = streams.subscribe("g")
    assert not streams.is_current("g", first) and streams.is_current("g", second)
    streams.publish("g", batch(2))
    assert old.empty()
    assert [new.get_nowait().events[0].request_id for _ in range(2)] == ["r1", "r2"]


def test_events_before_any_subscription_wait_for_it_and_close_forgets_the_gateway():
    streams = GatewayStreams()
    streams.publish("g", batch(1))
    generation, events = streams.subscribe("g")
    assert events.get_nowait().events[0].request_id == "r1"
    streams.close("g")
    assert not streams.is_current("g", generation)
