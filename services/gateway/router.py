"""Receives this gateway's token events from the scheduler and hands each to its request's queue."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from services.common.convert import output_from_pb
from pagedserve.engine.messages import RequestOutput
from services.common.pb import engine_pb2 as pb
from services.common.pb import engine_pb2_grpc

log = logging.getLogger("pagedserve.gateway")


class OutputRouter:
    """Holds the StreamOutputs call to the scheduler (reconnecting when it breaks) and routes events.

    Args:
        channel: an asyncio gRPC channel to the scheduler.
        gateway_id: this gateway's id, as written in its queued requests.
    """

    def __init__(self, channel: grpc.aio.Channel, gateway_id: str) -> None:
        self._stub = engine_pb2_grpc.SchedulerStub(channel)
        self._gateway_id = gateway_id
        self._queues: dict[str, asyncio.Queue[RequestOutput]] = {}
        self.connected = asyncio.Event()
        self._disconnected_at = time.monotonic()  # not yet connected counts as disconnected

    def register(self, request_id: str) -> asyncio.Queue[RequestOutput]:
        """A queue that receives the request's outputs. Raises ValueError if already registered."""
        if request_id in self._queues:
            raise ValueError(f"request_id {request_id!r} is already in flight")
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._queues[request_id] = queue
        return queue

    def unregister(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    def disconnected_for_s(self) -> float:
        """Seconds since the scheduler stream was lost (0 while connected)."""
        return 0.0 if self.connected.is_set() else time.monotonic() - self._disconnected_at

    @property
    def num_in_flight(self) -> int:
        return len(self._queues)

    async def abort(self, request_id: str, sample_index: int | None = None) -> None:
        """Asks the scheduler to stop a request (or one sample) and free its blocks (errors are logged)."""
        message = pb.AbortRequest(request_id=request_id)
        if sample_index is not None:
            message.sample_index = sample_index
        try:
            await self._stub.Abort(message, timeout=30)
        except grpc.RpcError as exc:
            log.warning("abort of %s failed: %s", request_id, exc)

    async def run(self) -> None:
        """Receives events until cancelled, reconnecting with backoff."""
        backoff = 0.1
        while True:
            call = self._stub.StreamOutputs(pb.StreamOutputsRequest(gateway_id=self._gateway_id))
            try:
                await call.wait_for_connection()
                self.connected.set()
                backoff = 0.1
                async for batch in call:
                    self._dispatch(batch)
            except grpc.RpcError as exc:
                log.warning("scheduler stream broke (%s); reconnecting", exc.code())
            finally:
                if self.connected.is_set():
                    self._disconnected_at = time.monotonic()
                self.connected.clear()
                call.cancel()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 2.0)

    def _dispatch(self, batch: pb.TokenEventBatch) -> None:
        for event in batch.events:
            queue = self._queues.get(event.request_id)
            if queue is not None:
                queue.put_nowait(output_from_pb(event))
