"""The gateway queues each submission once, through a real redis-server: a connection that breaks
after Redis ran the command but before its reply arrived makes redis-py send the command again, and
that must not put the request on the stream twice."""

from __future__ import annotations

import asyncio

import pytest

from pagedserve.engine.messages import EngineRequest
from pagedserve.engine.sampling_params import EngineSamplingParams
from pagedserve.services.common import redis_keys
from pagedserve.services.common.redis_pool import async_redis_client
from pagedserve.services.gateway.queue_producer import RequestQueueProducer

TOKEN = "q" * 32


class ReplyCutter:
    """A TCP proxy in front of Redis that, once, forwards a command naming the request stream and
    then closes the client's connection without its reply (Redis ran it; the client never hears)."""

    def __init__(self, redis_port: int) -> None:
        self.redis_port = redis_port
        self.armed = False
        self.cuts = 0

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self._server.sockets[0].getsockname()[1]

    async def _serve(self, client_reader, client_writer) -> None:
        server_reader, server_writer = await asyncio.open_connection("127.0.0.1", self.redis_port)
        swallow = asyncio.Event()

        async def replies() -> None:
            while data := await server_reader.read(65536):
                if not swallow.is_set():
                    client_writer.write(data)

        pump = asyncio.ensure_future(replies())
        try:
            while data := await client_reader.read(65536):
                cut = self.armed and redis_keys.REQUEST_STREAM.encode() in data
                if cut:
                    self.armed = False
                    swallow.set()
                server_writer.write(data)
                if cut:
                    await asyncio.sleep(0.3)  # Redis runs the command; its reply is dropped
                    self.cuts += 1
                    client_writer.transport.abort()
                    return
        finally:
            pump.cancel()
            server_writer.close()

    def close(self) -> None:
        self._server.close()


def test_a_command_sent_again_after_a_lost_reply_queues_the_request_once(redis_url, client):
    async def scenario() -> tuple[bytes, bytes, int]:
        cutter = ReplyCutter(int(redis_url.rsplit(":", 1)[1].split("/")[0]))
        port = await cutter.start()
        aclient = async_redis_client(f"redis://127.0.0.1:{port}/0", 4)
        try:
            producer = RequestQueueProducer(aclient, "gw-1", TOKEN)
            request = EngineRequest("req-1", (5, 6, 7), EngineSamplingParams(max_tokens=4), 0.0)
            first = await producer.enqueue(request)  # loads the script: the cut send below runs it
            cutter.armed = True
            return first, await producer.enqueue(request), cutter.cuts
        finally:
            await aclient.aclose()
            cutter.close()

    first, entry_id, cuts = asyncio.run(scenario())
    assert cuts == 1  # the reply of the cut send was lost: redis-py sent the command again
    entries = client.xrange(redis_keys.REQUEST_STREAM)
    assert [e[0] for e in entries] == [first, entry_id]


def test_each_submission_is_an_entry_of_its_own(redis_url, client):
    """A request queued again (Redis lost its entry) gets a new entry: the mark is per submission."""
    async def scenario() -> list[bytes]:
        aclient = async_redis_client(redis_url, 4)
        try:
            producer = RequestQueueProducer(aclient, "gw-1", TOKEN)
            request = EngineRequest("req-1", (5, 6, 7), EngineSamplingParams(max_tokens=4), 0.0)
            return [await producer.enqueue(request) for _ in range(2)]
        finally:
            await aclient.aclose()

    first, second = asyncio.run(scenario())
    assert first != second
    assert [e[0] for e in client.xrange(redis_keys.REQUEST_STREAM)] == [first, second]
    marks = client.keys("pagedserve:submission:*")
    assert len(marks) == 2 and all(0 < client.ttl(m) <= 120 for m in marks)


pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning")
