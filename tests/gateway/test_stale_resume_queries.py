"""Review of issue #13 (several schedulers): request ownership in the gateway when a resume query
is stale or refused, with a real Redis and real in-process Scheduler gRPC servers."""

from __future__ import annotations

import asyncio

import pytest

from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.services.common.pb import engine_pb2 as pb
from tests.gateway import scheduler_doubles
from tests.gateway.scheduler_doubles import FakeScheduler, Gateway, event, until, run_scenario

pytestmark = pytest.mark.timeout(60)
LENGTH = pb.FINISH_REASON_LENGTH


class Scheduler(FakeScheduler):
    """A FakeScheduler whose Resume answers ``found=self.found`` (a real scheduler answers False
    when it no longer waits for that request's resume: it handed the request off, or dropped it)."""

    found = True

    async def Resume(self, request, context):
        reply = await super().Resume(request, context)
        reply.found = self.found
        return reply


@pytest.fixture(autouse=True)
def refusable_schedulers(monkeypatch):
    monkeypatch.setattr(scheduler_doubles, "FakeScheduler", Scheduler)


def test_a_stale_resume_query_does_not_take_the_request_from_the_scheduler_that_resumed_it(client, redis_url):
    """s1 claims the request and queries the gateway, but the query waits in s1's output queue (the
    gateway's stream to s1 is down); s1 then hands the request off (no worker for 2 s) and s2 claims
    it, queries, is answered and streams. When s1's stream comes back, its stale query reaches the
    gateway. Were it followed, s1 would own the request (and answer found=False), s2's tokens would be
    dropped and s2 told to abort: the request would never finish. Its stamp (Redis's clock when s1
    took the request) is older than s2's, so the gateway ignores it."""

    async def scenario():
        async with Gateway(client, redis_url) as gw:
            gw.s1.found = False  # s1 no longer waits for this request's resume
            key = await gw.submit(SamplingParams(max_tokens=4))
            gw.s2.send(resume_queries=((key, 2_000),))  # s2 took the request over (from the hand-off consumer)
            await until(lambda: gw.s2.resumes, "the resume on s2")
            gw.s2.send(event(key, 0, [0, 1]))
            await until(lambda: gw.token_ids() == [0, 1], "s2's first tokens")
            gw.s1.send(resume_queries=((key, 1_000),))  # s1's stale query (s1 took it at 1000), delivered late
            await asyncio.sleep(0.5)
            gw.s2.send(event(key, 2, [2, 3], finish=LENGTH))
            await until(lambda: getattr(gw, "done", False), "the request to finish", timeout_s=5)
            assert gw.token_ids() == [0, 1, 2, 3] and not gw.s2.aborted(key) and not gw.s1.resumes

    run_scenario(scenario)

