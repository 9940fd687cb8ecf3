"""SchedulerLink against a real gRPC server (the scheduler double): the link counts as connected only
once the scheduler has answered the stream with its headers, so that a scheduler refusing every
stream stays down and its requests fail after the grace (instead of looking reachable at each retry)."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from pagedserve.services.common.pb import engine_pb2 as pb
from pagedserve.services.gateway.scheduler_link import SchedulerLink
from tests.gateway.scheduler_doubles import TOKEN, FakeScheduler, until, run_scenario


class SlowlyRefusing(FakeScheduler):
    """Refuses every stream after a moment, as a busy scheduler answers: the request was sent (what
    grpc's wait_for_connection waits for) well before the refusal comes."""

    def __init__(self, scheduler_id: str) -> None:
        super().__init__(scheduler_id)
        self.call_times: list[float] = []

    async def StreamOutputs(self, request, context):
        self.call_times.append(time.monotonic())
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
        gaps = [b - a for a, b in zip(scheduler.call_times, scheduler.call_times[1:])]
        assert len(gaps) >= 2  # a slow machine only lengthens gaps; 0.15 s each when a refusal restarted the backoff
        assert all(gap >= 0.1 * 2 ** i for i, gap in enumerate(gaps)), gaps

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


def test_closing_a_link_keeps_a_cancel_aimed_at_the_closer():
    """The discovery loop closes links; a cancel of the loop arriving then must end it (awaiting the
    link task inside suppress(CancelledError) swallowed it, and the loop ran on)."""
    async def scenario():
        scheduler = await FakeScheduler("s1").start()
        link = _link(scheduler, [])
        link.start()
        await until(lambda: link.connected, "the link up", 5)

        async def closer() -> str:
            await link.close()
            return "ran on"

        task = asyncio.ensure_future(closer())
        await asyncio.sleep(0)  # the closer has cancelled the link task and waits for it to end
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await link.close()
        await scheduler.stop()

    run_scenario(scenario)
