"""The gateway's check that the schedulers still hold its quiet requests (``HeldCheck``), with a real
Redis and real in-process Scheduler gRPC servers: a request whose owner forgot it ends UNAVAILABLE
after two checks, one still held waits on."""

from __future__ import annotations

import asyncio

import pytest

from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.services.gateway.generation_errors import StatusKind
from pagedserve.services.gateway.held_check import HeldCheck
from tests.gateway.scheduler_doubles import Gateway, event, run_scenario, until

pytestmark = pytest.mark.timeout(60)
CHECK_S = 0.3


def test_a_request_its_owner_no_longer_holds_ends_unavailable_and_a_held_one_waits_on(client, redis_url):
    async def scenario():
        async with Gateway(client, redis_url) as gw:
            check = asyncio.create_task(HeldCheck(gw.router, CHECK_S).run())
            lost, held = await gw.submit(SamplingParams(max_tokens=4)), await gw.submit(SamplingParams(max_tokens=4))
            gw.s1.send(event(lost, 0, [0]))
            gw.s2.send(event(held, 0, [1]))
            await until(lambda: len(gw.deltas) == 2, "a token of each")
            gw.s1.forgotten.add(lost)  # its last output was lost: s1 no longer holds it
            await until(lambda: getattr(gw, "error", None) is not None, "the lost request to fail", timeout_s=10)
            await asyncio.sleep(4 * CHECK_S)
            check.cancel()
            assert gw.error.kind is StatusKind.UNAVAILABLE
            assert gw.error.message == ("scheduler s1 no longer holds the request (its last output was lost); "
                                        "retry")
            assert gw.core.num_in_flight == 1  # the held one waits on
            assert any(held in q for q in gw.s2.held_queries) and not any(held in q for q in gw.s1.held_queries)
            assert [a.request_id for a in gw.s1.aborts] == [lost]  # the failed call aborts it, as any other

    run_scenario(scenario)


def test_a_request_heard_from_between_two_checks_is_not_ended(client, redis_url):
    async def scenario():
        async with Gateway(client, redis_url) as gw:
            check = HeldCheck(gw.router, CHECK_S)
            key = await gw.submit(SamplingParams(max_tokens=8))
            gw.s1.send(event(key, 0, [0]))
            await until(lambda: gw.token_ids() == [0], "the first token")
            gw.s1.forgotten.add(key)  # answers "not held" (a final in flight would look the same)
            await asyncio.sleep(CHECK_S)
            await check.check_once()  # first strike
            gw.s1.send(event(key, 1, [1]))
            await until(lambda: gw.token_ids() == [0, 1], "the second token")
            await asyncio.sleep(CHECK_S)
            await check.check_once()  # quiet again, but heard from since the first strike: a first strike
            await asyncio.sleep(0.2)
            assert getattr(gw, "error", None) is None and gw.core.num_in_flight == 1

    run_scenario(scenario)
