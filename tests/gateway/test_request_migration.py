"""Request ownership and migration in the gateway, through ``GenerationCore`` with a real Redis and
real in-process Scheduler gRPC servers: tokens are taken from the request's owner only, and a
scheduler that takes a request over is told exactly what the client received."""

from __future__ import annotations

import asyncio
import logging
import re
import time

import pytest

from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.text.request_samples import ParsedRequest
from pagedserve.services.common import redis_keys
from pagedserve.services.common.limits import MAX_LEASE_TTL_S
from pagedserve.services.common.redis_pool import async_redis_client
from pagedserve.services.common.pb import engine_pb2 as pb
from pagedserve.services.gateway.generation_core import TAKEOVER_S, GenerationCore, Submission
from pagedserve.services.gateway.generation_errors import GenerationError, StatusKind
from pagedserve.services.gateway.metrics import GatewayMetrics
from pagedserve.services.gateway.queue_producer import RequestQueueProducer
from pagedserve.services.gateway.router import OutputRouter
from tests.gateway.scheduler_doubles import TOKEN, Gateway, Letters, event, register, until, run_scenario

pytestmark = pytest.mark.timeout(60)
LENGTH = pb.FINISH_REASON_LENGTH


def test_tokens_come_from_the_owner_and_move_with_a_resume_query(client, redis_url):
    async def scenario():
        async with Gateway(client, redis_url) as gw:
            key = await gw.submit(SamplingParams(max_tokens=5))
            gw.s1.send(event(key, 0, [0, 1]))
            gw.s1.send(event(key, 2, [2]))
            await until(lambda: gw.token_ids() == [0, 1, 2], "s1's tokens")
            gw.s2.send(resume_queries=(key,))  # s2 took the request over
            await until(lambda: gw.s2.resumes, "the resume")
            (resume,) = gw.s2.resumes
            assert (resume.request_id, resume.gateway_id, resume.num_migrations) == (key, "gw-1", 1)
            assert [(s.sample_index, list(s.token_ids), s.finished) for s in resume.samples] == [(0, [0, 1, 2], False)]
            gw.s1.send(event(key, 3, [9]))  # s1 lost its lease but still streams: fenced
            await until(lambda: gw.s1.aborted(key), "an abort to s1")
            gw.s2.send(event(key, 2, [2, 3]))  # a repeat of a received token is dropped
            gw.s2.send(event(key, 4, [4], finish=LENGTH))
            await until(lambda: getattr(gw, "done", False), "the request to finish")
            assert gw.token_ids() == [0, 1, 2, 3, 4] and gw.text() == "abcde"
            assert gw.deltas[-1].usage.completion_tokens == 5
            assert len(gw.s1.aborted(key)) == 1 and gw.s2.aborts == []
            assert gw.metrics.requests_migrated._value.get() == 1

    run_scenario(scenario)


def test_resume_carries_each_samples_received_tokens_and_finish(client, redis_url):
    async def scenario():
        async with Gateway(client, redis_url) as gw:
            key = await gw.submit(SamplingParams(max_tokens=4, n=2, stop=("cd",)))
            gw.s1.send(event(key, 0, [0, 2], sample_index=0))  # "ac": "c" is held back (a stop may begin)
            gw.s1.send(event(key, 0, [2], sample_index=1), event(key, 1, [3], sample_index=1))  # "cd": stopped
            await until(lambda: gw.s1.aborted(key), "sample 1 aborted on its owner")
            assert [a.sample_index for a in gw.s1.aborts] == [1] and gw.text(0) == "a" and gw.text(1) == ""
            gw.s2.send(resume_queries=(key,))
            await until(lambda: gw.s2.resumes, "the first resume")
            # the count goes up when the gateway has s2's answer (a query before it carries 1 again: seen in CI)
            await until(lambda: gw.metrics.requests_migrated._value.get() == 1, "the first resume confirmed")
            gw.s1.send(resume_queries=(key,))  # and back to s1
            await until(lambda: gw.s1.resumes, "the second resume")
            for scheduler, migrations in ((gw.s2, 1), (gw.s1, 2)):
                (resume,) = scheduler.resumes
                assert resume.num_migrations == migrations
                assert [(s.sample_index, list(s.token_ids), s.finished) for s in resume.samples] == [
                    (0, [0, 2], False), (1, [2, 3], True)]
            gw.s1.send(event(key, 2, [4, 5], sample_index=0, finish=LENGTH))
            await until(lambda: getattr(gw, "done", False), "the request to finish")
            assert gw.text(0) == "acef" and gw.token_ids(0) == [0, 2, 4, 5]
            assert gw.metrics.requests_migrated._value.get() == 2

    run_scenario(scenario)


def test_a_resume_query_or_tokens_for_a_request_nobody_waits_for_get_an_abort(client, redis_url):
    async def scenario():
        async with Gateway(client, redis_url) as gw:
            gw.s1.send(resume_queries=("gone",))
            gw.s2.send(event("orphan", 0, [1]))
            gw.s2.send(event("orphan", 1, [2]))  # aborted once per scheduler
            await until(lambda: gw.s1.aborted("gone") and gw.s2.aborted("orphan"), "the aborts")
            await asyncio.sleep(0.2)
            assert len(gw.s2.aborted("orphan")) == 1 and gw.s1.resumes == gw.s2.resumes == []

    run_scenario(scenario)


def test_a_client_that_leaves_before_any_scheduler_answered_aborts_on_every_scheduler(client, redis_url):
    async def scenario():
        async with Gateway(client, redis_url) as gw:
            key = await gw.submit(SamplingParams(max_tokens=4))
            gw._tasks[-1].cancel()  # the client goes away
            await until(lambda: gw.s1.aborted(key) and gw.s2.aborted(key), "an abort to each scheduler")
            await until(lambda: client.xlen(redis_keys.REQUEST_STREAM) == 0, "the stream entry deleted")

    run_scenario(scenario)


def test_a_client_that_leaves_before_the_gateway_read_its_entry_id_leaves_no_stream_entry(client, redis_url):
    async def scenario():
        async with Gateway(client, redis_url) as gw:
            client.execute_command("CLIENT", "PAUSE", 20_000, "WRITE")
            params = SamplingParams(max_tokens=4)
            task = asyncio.create_task(gw._collect(Submission(ParsedRequest((1,), params,
                                                                            params.to_engine(1, 100, 26, ())))))
            await until(lambda: client.info("clients")["blocked_clients"] == 1, "the XADD waiting in Redis")
            client.execute_command("CLIENT", "UNPAUSE")
            time.sleep(0.3)  # the event loop blocked: Redis queues the entry, the gateway has not read the reply
            assert client.xlen(redis_keys.REQUEST_STREAM) == 1
            task.cancel()  # the client goes away before the gateway knows the entry's id
            await asyncio.gather(task, return_exceptions=True)
            await until(lambda: client.xlen(redis_keys.REQUEST_STREAM) == 0, "the entry deleted", timeout_s=5.0)

    run_scenario(scenario)


def test_an_abort_that_failed_is_sent_again_when_the_scheduler_streams_on_for_the_request(client, redis_url):
    async def scenario():
        async with Gateway(client, redis_url) as gw:
            key = await gw.submit(SamplingParams(max_tokens=50))
            gw.s1.send(event(key, 0, [0]))
            await until(lambda: gw.token_ids() == [0], "the first token")
            gw.s1.aborts_to_fail = 1
            gw._tasks[-1].cancel()  # the client goes away; the owner's Abort fails
            await until(lambda: len(gw.s1.aborted(key)) == 1 and not gw.router.background.num_running, "the failed abort")
            gw.s1.send(event(key, 1, [1]), event(key, 2, [2]))  # s1 still runs the request
            await until(lambda: len(gw.s1.aborted(key)) == 2, "the abort sent again")
            await asyncio.sleep(0.3)
            assert len(gw.s1.aborted(key)) == 2 and gw.s2.aborted(key) == []  # once per failure, to the owner only

    run_scenario(scenario)


def test_a_burst_of_requests_is_held_to_the_gateway_limit(client, redis_url):
    # the front ends check the limit before parsing (off the event loop): a burst all passes that check
    async def scenario():
        async with Gateway(client, redis_url) as gw:  # its core holds 8 requests at most
            params = SamplingParams(max_tokens=4)
            streams = [gw.core.generate(Submission(ParsedRequest((1,), params, params.to_engine(1, 100, 26, ()))))
                       for _ in range(11)]
            firsts = [asyncio.ensure_future(anext(stream)) for stream in streams]
            await until(lambda: client.xlen(redis_keys.REQUEST_STREAM) == 8, "8 requests queued")
            await asyncio.sleep(0.2)
            refused = [f.exception() for f in firsts if f.done()]
            assert [e.kind for e in refused] == [StatusKind.RESOURCE_EXHAUSTED] * 3, refused
            assert gw.core.num_in_flight == 8 and client.xlen(redis_keys.REQUEST_STREAM) == 8
            for first in firsts:
                first.cancel()
            await asyncio.gather(*firsts, return_exceptions=True)
            for stream in streams:
                await stream.aclose()

    run_scenario(scenario)


def test_a_request_fails_when_its_owner_stays_unreachable_even_if_another_scheduler_is_up(client, redis_url, caplog):
    async def scenario():
        async with Gateway(client, redis_url, grace_s=1.0) as gw:
            key = await gw.submit(SamplingParams(max_tokens=4))
            gw.s1.send(event(key, 0, [0]))
            await until(lambda: gw.token_ids() == [0], "the first token")
            gw.s1.refuse_streams()  # s1 died and no scheduler took the request over
            await until(lambda: getattr(gw, "done", False), "the request to fail", timeout_s=15)
            assert gw.error.kind == StatusKind.UNAVAILABLE
            assert re.fullmatch(r"lost the connection to the request's scheduler for \d+\.\d s, longer than the "
                                r"gateway waits \(1 s\); retry", gw.error.message), gw.error.message
            warning = next((r.getMessage() for r in caplog.records if "ends UNAVAILABLE" in r.getMessage()), None)
            assert warning is not None, "no warning logged"
            assert f"request {key} (and any other of scheduler s1 failing in the next 1 s)" in warning, warning
            assert "s2 (connected)" in warning, warning
            assert re.search(r"s1 \(down \d+\.\d s\)", warning), warning
            gw.core.check_scheduler()  # s2 is up: new requests are accepted

    caplog.set_level(logging.WARNING, logger="pagedserve.gateway")

    run_scenario(scenario)


def test_a_request_waits_out_its_dead_schedulers_lease_for_the_takeover(client, redis_url):
    """The gateway waits at least the longest lease TTL the schedulers registered plus ``TAKEOVER_S``: the survivor
    that takes the request over once the dead one's 2-s lease expired finds it waiting (with the configured 1 s
    alone it had ended UNAVAILABLE, as a scheduler started with --lease-ttl over the gateway's grace made them)."""
    async def scenario():
        async with Gateway(client, redis_url, grace_s=1.0, lease_ttl_s=2.0) as gw:
            assert gw.core.grace_s() == 2.0 + TAKEOVER_S
            key = await gw.submit(SamplingParams(max_tokens=2))
            gw.s1.send(event(key, 0, [0]))
            await until(lambda: gw.token_ids() == [0], "the first token")
            gw.s1.refuse_streams()  # s1 died
            await asyncio.sleep(2.5)  # its lease expires; s2 notices and claims the request
            assert not getattr(gw, "done", False), gw.error.message
            gw.s2.send(resume_queries=(key,))
            await until(lambda: gw.s2.resumes, "the resume")
            gw.s2.send(event(key, 1, [1], finish=LENGTH))
            await until(lambda: getattr(gw, "done", False), "the request to finish")
            assert gw.token_ids() == [0, 1] and not hasattr(gw, "error")

    run_scenario(scenario)


def test_a_registered_lease_ttl_counts_at_most_the_longest_a_scheduler_accepts(client, redis_url):
    async def scenario():
        async with Gateway(client, redis_url, grace_s=1.0, lease_ttl_s=1e9) as gw:
            assert gw.core.grace_s() == MAX_LEASE_TTL_S + TAKEOVER_S

    run_scenario(scenario)


def test_new_requests_are_refused_when_no_scheduler_was_reachable_for_the_grace(client, redis_url):
    async def scenario():
        aclient = async_redis_client(redis_url, 8)
        router = OutputRouter(aclient, TOKEN, "gw-1")
        core = GenerationCore(Letters(), RequestQueueProducer(aclient, "gw-1", TOKEN), router, 8, GatewayMetrics("m"),
                              scheduler_grace_s=0.2)
        core.check_scheduler()
        await asyncio.sleep(0.3)
        with pytest.raises(GenerationError) as caught:
            core.check_scheduler()
        assert caught.value.kind == StatusKind.UNAVAILABLE

    run_scenario(scenario)


def test_a_request_redis_lost_before_any_scheduler_took_it_is_queued_again(client, redis_url):
    """Redis restarts empty while a request waits in the stream: no scheduler will ever read it. It
    used to fail with UNAVAILABLE; since nothing ran for it yet, it is queued again and completes."""
    async def scenario():
        async with Gateway(client, redis_url) as gw:
            key = await gw.submit(SamplingParams(max_tokens=2))
            client.flushall()  # Redis restarted empty; the schedulers register again
            register(client, "s1", gw.s1.address)
            register(client, "s2", gw.s2.address)
            await until(lambda: client.xlen(redis_keys.REQUEST_STREAM) == 1, "the request queued again", 10)
            (_, fields), = client.xrange(redis_keys.REQUEST_STREAM)
            assert pb.QueuedRequest.FromString(fields[redis_keys.REQUEST_FIELD]).request_id == key
            gw.s1.send(event(key, 0, [0, 1], finish=LENGTH))
            await until(lambda: getattr(gw, "done", False), "the request to finish")
            assert gw.token_ids() == [0, 1] and not hasattr(gw, "error")

    run_scenario(scenario)
