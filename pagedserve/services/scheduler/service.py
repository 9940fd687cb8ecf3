"""The Scheduler gRPC service: a thin shell that hands requests to the scheduler loop."""

from __future__ import annotations

import queue
from collections.abc import Iterator
from concurrent.futures import Future

import grpc

from pagedserve.engine.messages import SequenceId
from pagedserve.services.common.convert import stats_to_pb
from pagedserve.services.common.pb import engine_pb2 as pb
from pagedserve.services.common.pb import engine_pb2_grpc
from pagedserve.services.common.limits import MAX_HELD_QUERY_IDS
from pagedserve.services.scheduler.commands import Abort, AbortSample, GatewayBack, GatewayGone, HeldRequests, Resume
from pagedserve.services.scheduler.loop import SchedulerLoop


class SchedulerServicer(engine_pb2_grpc.SchedulerServicer):
    """StreamOutputs, Abort, Resume and GetStats over a running ``SchedulerLoop``."""

    def __init__(self, loop: SchedulerLoop, abort_timeout_s: float = 30.0) -> None:
        self._loop = loop
        self._abort_timeout_s = abort_timeout_s

    def StreamOutputs(self, request: pb.StreamOutputsRequest, context: grpc.ServicerContext) -> Iterator[pb.TokenEventBatch]:
        """Streams the token events of one gateway's requests until the gateway goes away."""
        if not request.gateway_id:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "gateway_id: must not be empty")
        own_id = self._loop.config.consumer_name
        if request.scheduler_id and request.scheduler_id != own_id:  # its address was reused by another scheduler
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"this is scheduler {own_id}, not {request.scheduler_id}: read the schedulers from Redis again")
        context.send_initial_metadata(())  # lets the gateway see the stream is up before any event
        streams, gateway_id = self._loop.streams, request.gateway_id
        generation, events = streams.subscribe(gateway_id)
        self._loop.submit(GatewayBack(gateway_id, generation))
        gone = GatewayGone(gateway_id, generation)
        if not context.add_callback(lambda: self._loop.submit(gone)):  # the call ended already: no callback
            self._loop.submit(gone)
        while context.is_active() and streams.is_current(gateway_id, generation):
            try:
                yield events.get(timeout=0.5)
            except queue.Empty:
                continue

    def Abort(self, request: pb.AbortRequest, context: grpc.ServicerContext) -> pb.AbortResponse:
        """Aborts a request (or one sample) in the loop and waits until it is done."""
        done: Future = Future()
        if request.HasField("sample_index"):
            self._loop.submit(AbortSample(SequenceId(request.request_id, request.sample_index), done))
        else:
            self._loop.submit(Abort(request.request_id, done))
        try:
            return pb.AbortResponse(found=done.result(timeout=self._abort_timeout_s))
        except TimeoutError:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"the scheduler did not answer in {self._abort_timeout_s:g} s; retry")

    def Resume(self, request: pb.ResumeRequest, context: grpc.ServicerContext) -> pb.ResumeResponse:
        """Continues a request this scheduler took over, after the tokens its client received.
        An account that does not fit the request (a sample index or token count out of range) is
        INVALID_ARGUMENT, and the request ends with that error."""
        if not request.request_id or not request.gateway_id:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id and gateway_id: must not be empty")
        done: Future = Future()
        self._loop.submit(Resume(request, done))
        try:
            return pb.ResumeResponse(found=done.result(timeout=self._abort_timeout_s))
        except TimeoutError:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"the scheduler did not answer in {self._abort_timeout_s:g} s; retry")
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    def HeldRequests(self, request: pb.HeldRequestsRequest, context: grpc.ServicerContext) -> pb.HeldRequestsResponse:
        """Which of the given requests this scheduler holds (a gateway's check of the quiet ones)."""
        if len(request.request_ids) > MAX_HELD_QUERY_IDS:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"request_ids: at most {MAX_HELD_QUERY_IDS}, got {len(request.request_ids)}")
        done: Future = Future()
        self._loop.submit(HeldRequests(tuple(request.request_ids), done))
        try:
            return pb.HeldRequestsResponse(request_ids=done.result(timeout=self._abort_timeout_s))
        except TimeoutError:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"the scheduler did not answer in {self._abort_timeout_s:g} s; retry")

    def GetStats(self, request: pb.GetStatsRequest, context: grpc.ServicerContext) -> pb.SchedulerStats:
        """The loop's latest snapshot of queues and KV occupancy."""
        return stats_to_pb(self._loop.stats)
