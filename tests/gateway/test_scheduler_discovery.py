"""The gateway finds its schedulers in a real Redis and keeps a real gRPC stream open to each live one."""

from __future__ import annotations

import asyncio

import pytest

from pagedserve.services.common.redis_pool import async_redis_client
from pagedserve.services.gateway.scheduler_discovery import SchedulerDiscovery
from tests.gateway.scheduler_doubles import TOKEN, FakeScheduler, register, until, run_scenario

pytestmark = pytest.mark.timeout(60)


def ignore(scheduler_id, batch) -> None:
    pass


def test_connects_to_every_live_scheduler_and_drops_one_whose_lease_expired_once_its_stream_breaks(client, redis_url):
    async def scenario():
        s1, s2 = await FakeScheduler("s1").start(), await FakeScheduler("s2").start()
        register(client, "s1", s1.address)
        register(client, "s2", s2.address, lease_ms=1500)
        discovery = SchedulerDiscovery(async_redis_client(redis_url, 8), TOKEN, "gw-1", ignore, poll_interval_s=0.1)
        assert discovery.none_connected_for_s() > 0
        task = asyncio.create_task(discovery.run())
        try:
            await until(lambda: len(discovery.connected_links()) == 2, "both streams")
            await until(lambda: s1.open_streams == s2.open_streams == 1, "both schedulers to see a stream")
            assert s1.stream_gateways == s2.stream_gateways == ["gw-1"]
            assert discovery.none_connected_for_s() == 0
            await asyncio.sleep(2.0)  # s2's lease expired, but its open stream shows it alive (Redis restarted?)
            assert sorted(link.scheduler_id for link in discovery.connected_links()) == ["s1", "s2"]  # hash order
            await s2.stop()  # now it is gone
            await until(lambda: "s2" not in discovery.links, "s2 to leave once its lease expired and its stream broke")
            assert [link.scheduler_id for link in discovery.connected_links()] == ["s1"]
            assert discovery.down_for_s("s2") > 0 and discovery.down_for_s("s1") == 0
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await asyncio.gather(s1.stop(), s2.stop())
        assert s1.open_streams == 0  # cancelling discovery closes its streams

    run_scenario(scenario)


def test_registrations_not_signed_with_the_cluster_token_are_ignored(client, redis_url):
    async def scenario():
        good, unsigned, foreign = [await FakeScheduler(n).start() for n in ("good", "unsigned", "foreign")]
        register(client, "good", good.address)
        register(client, "unsigned", unsigned.address, token=None)
        register(client, "foreign", foreign.address, token="another-cluster's-token")
        client.hset("pagedserve:schedulers", "garbage", b"\xff\x00not a protobuf")
        client.set("pagedserve:scheduler:garbage:lease", "x")
        discovery = SchedulerDiscovery(async_redis_client(redis_url, 8), TOKEN, "gw-1", ignore)
        try:
            for _ in range(2):  # the second refresh reuses what the first one checked
                await discovery.refresh()
                assert set(discovery.links) == {"good"}
        finally:
            await discovery.close()
            await asyncio.gather(*(s.stop() for s in (good, unsigned, foreign)))
        assert unsigned.stream_gateways == foreign.stream_gateways == []

    run_scenario(scenario)


def test_a_registration_whose_lease_holds_another_instance_is_not_live(client, redis_url):
    async def scenario():
        s1 = await FakeScheduler("s1").start()
        register(client, "s1", s1.address)
        client.set("pagedserve:scheduler:s1:lease", "an-earlier-instance")
        discovery = SchedulerDiscovery(async_redis_client(redis_url, 8), TOKEN, "gw-1", ignore)
        try:
            await discovery.refresh()
            assert discovery.links == {}
        finally:
            await discovery.close()
            await s1.stop()

    run_scenario(scenario)
