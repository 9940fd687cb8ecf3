"""One gateway's connection to one scheduler: its channel and its StreamOutputs call."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import grpc

from pagedserve.services.common.auth import cluster_aio_channel
from pagedserve.services.common.pb import engine_pb2 as pb
from pagedserve.services.common.pb import engine_pb2_grpc

log = logging.getLogger("pagedserve.gateway")

FIRST_BACKOFF_S = 0.1
"""Wait before the first reconnection of a broken stream, seconds (doubled after each failure)."""

MAX_BACKOFF_S = 2.0
"""Longest wait between reconnections, seconds."""

BatchHandler = Callable[[str, pb.TokenEventBatch], None]
"""Called with (scheduler id, batch) for every batch a scheduler streams."""


CLOSE_WAIT_S = 2.0
"""Longest wait for a closed link's channel to close, seconds (see ``SchedulerLink.close``)."""

class SchedulerLink:
    """Holds the StreamOutputs call to one scheduler open until closed, reconnecting with backoff.

    Args:
        registration: the scheduler's (verified, live) registration: its id and address.
        cluster_token: sent with every call (``cluster_aio_channel``).
        gateway_id: this gateway's id, as written in its queued requests.
        on_batch: receives every batch, on the event loop.
        on_change: called after the stream connects or breaks (the caller recomputes its state).
        down_since: ``time.monotonic()`` from which a not yet connected link counts as down
            (default: now).
    """

    def __init__(self, registration: pb.SchedulerRegistration, cluster_token: str, gateway_id: str,
                 on_batch: BatchHandler, on_change: Callable[[], None], down_since: float | None = None) -> None:
        self.scheduler_id = registration.scheduler_id
        self.address = registration.address
        self.channel = cluster_aio_channel(self.address, cluster_token)
        self.stub = engine_pb2_grpc.SchedulerStub(self.channel)
        self.connected = False
        self._gateway_id = gateway_id
        self._on_batch = on_batch
        self._on_change = on_change
        self._down_since = time.monotonic() if down_since is None else down_since
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """Starts streaming (on the running event loop)."""
        self._task = asyncio.get_running_loop().create_task(self._run())

    def down_for_s(self) -> float:
        """Seconds since the stream was lost, or since the link was made while it never connected;
        0 while connected."""
        return 0.0 if self.connected else time.monotonic() - self._down_since

    @property
    def down_since(self) -> float:
        """``time.monotonic()`` when the stream was last lost (meaningless while connected)."""
        return self._down_since

    async def close(self) -> None:
        """Ends the stream and closes the channel (the link cannot be started again)."""
        if self._task is not None:
            self._task.cancel()
            # asyncio.wait neither raises the link task's CancelledError nor swallows one aimed at the
            # caller (awaiting the task inside suppress(CancelledError) lost the caller's own cancel)
            await asyncio.wait({self._task})
        self._set_connected(False)
        # grpc.aio's close waits for the channel's calls to end, which a call racing the close now and
        # then never does (a CI run hung there): bounded, without cancelling it (as wait_for would).
        await asyncio.wait({asyncio.ensure_future(self.channel.close())}, timeout=CLOSE_WAIT_S)

    def _set_connected(self, connected: bool) -> None:
        if connected == self.connected:
            return
        self.connected = connected
        if not connected:
            self._down_since = time.monotonic()
        self._on_change()

    async def _run(self) -> None:
        backoff = FIRST_BACKOFF_S
        while True:
            request = pb.StreamOutputsRequest(gateway_id=self._gateway_id, scheduler_id=self.scheduler_id)
            call = self.stub.StreamOutputs(request)
            try:
                # up only once the scheduler's headers came (it sends them when it has subscribed this
                # gateway): wait_for_connection only means the request was sent, and a scheduler that
                # refuses every stream would count as reachable at each retry, its requests never failing
                await call.initial_metadata()
                if not call.done():  # else a refusal (a trailers-only answer), which the loop below raises
                    self._set_connected(True)
                    backoff = FIRST_BACKOFF_S  # a refusing scheduler is retried ever more slowly
                async for batch in call:
                    self._on_batch(self.scheduler_id, batch)
            except grpc.RpcError as exc:
                self._log_broken(exc)
            except Exception:  # a bug in a handler: logged, and the stream made again
                log.exception("stream of scheduler %s failed; reconnecting", self.scheduler_id)
            finally:
                self._set_connected(False)
                call.cancel()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, MAX_BACKOFF_S)

    def _log_broken(self, exc: grpc.RpcError) -> None:
        if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
            log.error("scheduler %s at %s refused this gateway's cluster token: give the gateway the scheduler's "
                      "(--cluster-token-file, --cluster-token or PAGEDSERVE_CLUSTER_TOKEN); retrying",
                      self.scheduler_id, self.address)
        else:
            log.warning("stream of scheduler %s at %s broke (%s); reconnecting", self.scheduler_id, self.address,
                        exc.code())
