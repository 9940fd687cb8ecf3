"""Receives this gateway's token events from the scheduler and hands each to its request's queue."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict

import grpc

from services.common.convert import output_from_pb
from pagedserve.engine.messages import RequestOutput
from services.common.pb import engine_pb2 as pb
from services.common.pb import engine_pb2_grpc

log = logging.getLogger("pagedserve.gateway")


MAX_ORPHAN_ABORTS = 4096
"""Most recently aborted orphans remembered, so each is aborted once."""


class OutputRouter:
    """Holds the StreamOutputs call to the scheduler (reconnecting when it breaks) and routes events.

    Tokens of a request that no call here waits for (an orphan: its client already got an error,
    and a restarted scheduler runs it again) make the router abort it in the scheduler.

    Args:
        channel: an asyncio gRPC channel to the scheduler.
        gateway_id: this gateway's id, as written in its queued requests.
    """

    def __init__(self, channel: grpc.aio.Channel, gateway_id: str) -> None:
        self._stub = engine_pb2_grpc.SchedulerStub(channel)
        self._gateway_id = gateway_id
        self._queues: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._orphans: OrderedDict[str, None] = OrderedDict()
        self._background: set[asyncio.Task] = set()
        self.connected = asyncio.Event()
        self._disconnected_at = time.monotonic()  # not yet connected counts as disconnected

    def register(self, key: str) -> asyncio.Queue[RequestOutput]:
        """A queue that receives the outputs of the request with this (gateway-made, unique) key.

        Raises:
            ValueError: the key is registered already (a bug: keys are new per submission).
        """
        if key in self._queues:
            raise ValueError(f"request {key!r} is registered already")
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._queues[key] = queue
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
                if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
                    log.error("the scheduler refused this gateway's cluster token: give the gateway the scheduler's "
                              "(--cluster-token-file, --cluster-token or PAGEDSERVE_CLUSTER_TOKEN); retrying")
                else:
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
            elif not event.finish_reason and event.request_id not in self._orphans:
                self._abort_orphan(event.request_id)

    def _abort_orphan(self, key: str) -> None:
        log.info("aborting %s: no call waits for its tokens", key)
        self._orphans[key] = None
        if len(self._orphans) > MAX_ORPHAN_ABORTS:
            self._orphans.popitem(last=False)
        task = asyncio.get_running_loop().create_task(self.abort(key))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
