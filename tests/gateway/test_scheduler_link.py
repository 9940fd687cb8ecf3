"""SchedulerLink against a real gRPC server (the scheduler double): the link counts as connected only
once the scheduler has answered the stream with its headers, so that a scheduler refusing every
stream stays down and its requests fail after the grace (instead of looking reachable at each retry)."""

from __future__ import annotations

import asyncio

import grpc

from services.common.pb import engine_pb2 as pb
from services.gateway.scheduler_link import SchedulerLink
from tests.gateway.scheduler_doubles import TOKEN, FakeScheduler, until, run_scenario


class SlowlyRefusing(FakeScheduler):
    """Refuses every stream after a moment, as a busy scheduler answers: the request was sent (what
    grpc's wait_for_connection waits for) well before the refusal comes."""

    calls = 0

    async def StreamOutputs(self, request, context):
        self.calls += 1
        await asyncio.sleep(0.05)
        await context.abort(grpc.StatusCode.UNAVAILABLE, "this scheduler is gone")
        yield pb.TokenEventBatch()  # never reached: makes this an async generator like the real one


def _link(scheduler: FakeScheduler, changes: list[bool]) -> SchedulerLink:
    registration = pb.SchedulerRegistration(scheduler_id=scheduler.scheduler_id, address=scheduler.address)
    link = SchedulerLink(registration, TOKEN, "gw-1", lambda *_: None, lambda: changes.append(link.connected))
    return link


def test_a_scheduler_refusing_every_stream_never_counts_as_connected_and_is_retried_ever_more_slowly():
    async def scenario():
        scheduler = await SlowlyRefusing("s1").start()
        changes: list[bool] = []
        link = _link(scheduler, changes)
        link.start()
        await asyncio.sleep(1.5)  # calls at about 0, 0.15, 0.4 and 0.85 s (waits of 0.1, 0.2, 0.4 s after each refusal)
        down_for = link.down_for_s()
        await link.close()
        await scheduler.stop()
        assert True not in changes and down_for >= 1.4
        assert 3 <= scheduler.calls <= 5  # 10 when every refusal restarted the backoff at 0.1 s

    run_scenario(scenario)


def test_a_stream_answered_with_headers_counts_as_connected_before_any_event():
    async def scenario():
        scheduler = await FakeScheduler("s1").start()
        changes: list[bool] = []
        link = _link(scheduler, changes)
        link.start()
        await until(lambda: link.connected, "the link up", 5)
        assert link.down_for_s() == 0.0
        await link.close()
        await scheduler.stop()
        assert changes == [True, False]

    run_scenario(scenario)
