"""GatewayStreams: the newest subscription of a gateway id is the current one and takes its events."""

from __future__ import annotations

from pagedserve.services.common.pb import engine_pb2 as pb
from pagedserve.services.scheduler.gateway_streams import GatewayStreams


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


def test_events_before_any_subscription_wait_for_it():
    streams = GatewayStreams()
    streams.publish("g", batch(1))
    generation, events = streams.subscribe("g")
    assert events.get_nowait().events[0].request_id == "r1"
    assert streams.is_current("g", generation)


def test_a_retired_gateway_is_forgotten_at_its_time_unless_it_subscribes_again():
    streams = GatewayStreams()
    generation, _ = streams.subscribe("gone")
    streams.retire("gone", until_s=10.0)
    streams.drop_retired(now_s=9.9)
    assert streams.is_current("gone", generation)
    streams.drop_retired(now_s=10.0)
    assert not streams.is_current("gone", generation)


def test_a_gateway_back_after_its_requests_were_dropped_still_gets_their_finals():
    streams = GatewayStreams()
    streams.subscribe("g")
    streams.publish("g", batch(1))  # the ABORT final of a request dropped at the end of the grace
    streams.retire("g", until_s=10.0)
    generation, events = streams.subscribe("g")  # the gateway reconnects just then
    streams.drop_retired(now_s=11.0)
    assert streams.is_current("g", generation) and events.get_nowait().events[0].request_id == "r1"
