"""The gateway's calls made without waiting (``BackgroundCalls``): a shutdown lets them end, within a bound."""

from __future__ import annotations

import asyncio
import time

from pagedserve.services.gateway.background import BackgroundCalls


def test_settle_waits_for_the_running_calls_and_those_they_start():
    done = []

    async def scenario() -> int:
        calls = BackgroundCalls()

        async def abort(name: str, then: str | None = None) -> None:
            await asyncio.sleep(0.1)
            done.append(name)
            if then is not None:  # e.g. an entry deleted once queued
                calls.start(abort(then))

        calls.start(abort("first", then="started by first"))
        calls.start(abort("second"))
        return await calls.settle(5.0)

    assert asyncio.run(scenario()) == 0
    assert sorted(done) == ["first", "second", "started by first"]


def test_settle_gives_up_after_its_bound_and_says_how_many_still_run():
    async def scenario() -> tuple[int, float, int]:
        calls = BackgroundCalls()
        calls.start(asyncio.sleep(60))  # a call to a scheduler that never answers
        calls.start(asyncio.sleep(0.05))
        started = time.monotonic()
        left = await calls.settle(0.3)
        return left, time.monotonic() - started, calls.num_running

    left, waited_s, running = asyncio.run(scenario())
    assert left == 1 and running == 1
    assert 0.3 <= waited_s < 1.0
