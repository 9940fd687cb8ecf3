"""The requests a scheduler runs, and where each one's outputs go: the one owner of routes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from opentelemetry import trace

from pagedserve.engine.messages import EngineRequest
from pagedserve.engine.outputs import RequestOutput
from pagedserve.engine.scheduler import Scheduler
from services.common import telemetry
from services.common.convert import output_to_pb
from services.common.pb import engine_pb2 as pb
from services.scheduler.gateway_streams import GatewayStreams
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.queue_consumer import QueueEntry


@dataclass
class _Route:
    """Where a request came from and where its tokens go."""

    entry: QueueEntry
    span: trace.Span

    @property
    def gateway_id(self) -> str:
        return self.entry.request.gateway_id


class Routes:
    """Opens a route per request taken, sends outputs to their gateways, and closes a route (its
    span ended, its stream entry acknowledged) once no sample of its request is in flight.

    Args:
        scheduler: the engine scheduler (asked whether a request is still in flight).
        streams: the gateways' output queues.
        ack: acknowledges a finished request's stream entry (never blocks).
        metrics: the scheduler's series.
        tracer: makes each request's span.
    """

    def __init__(self, scheduler: Scheduler, streams: GatewayStreams, ack: Callable[[bytes], None],
                 metrics: SchedulerMetrics, tracer: trace.Tracer) -> None:
        self._scheduler = scheduler
        self._streams = streams
        self._ack = ack
        self._metrics = metrics
        self._tracer = tracer
        self._routes: dict[str, _Route] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._routes

    def entry_id(self, request_id: str) -> bytes | None:
        """The stream entry of a request this scheduler runs (None: no route)."""
        route = self._routes.get(request_id)
        return None if route is None else route.entry.entry_id

    def of_gateway(self, gateway_id: str) -> list[str]:
        """Ids of the requests whose outputs go to ``gateway_id``."""
        return [r for r, route in self._routes.items() if route.gateway_id == gateway_id]

    def open(self, entry: QueueEntry, request: EngineRequest) -> EngineRequest:
        """Opens the request's route and span; returns the request carrying the span's context."""
        span = self._tracer.start_span(
            "scheduler.request", context=telemetry.extract(request.trace_context),
            attributes={"request_id": request.request_id, "prompt_tokens": len(request.prompt_token_ids)},
        )
        request = replace(request, trace_context=telemetry.inject(trace.set_span_in_context(span)))
        self._routes[request.request_id] = _Route(entry, span)
        self._metrics.request_added(request.request_id)
        return request

    def deliver(self, outputs: list[RequestOutput]) -> None:
        """Sends outputs to their gateways, one batch per gateway; closes the routes of requests
        that have no sample left in flight (after the whole batch, so that every sample's last
        output goes out)."""
        batches: dict[str, list[pb.TokenEvent]] = {}
        self._metrics.outputs(outputs)
        for output in outputs:
            route = self._routes.get(output.request_id)
            if route is None:
                continue
            batches.setdefault(route.gateway_id, []).append(output_to_pb(output))
            if output.first_output_index == 0 and output.new_token_ids:
                route.span.add_event("first_token")
            if output.finished:
                route.span.add_event("sample_finished", {"finish_reason": output.finish_reason.value})
        for request_id in {o.request_id for o in outputs}:
            self.close_if_done(request_id)
        for gateway_id, events in batches.items():
            self._streams.publish(gateway_id, pb.TokenEventBatch(events=events))

    def close_if_done(self, request_id: str) -> None:
        """Closes the request's route if none of its samples is in flight."""
        if request_id in self._routes and not self._scheduler.has_request(request_id):
            route = self._routes.pop(request_id)
            route.span.end()
            self._ack(route.entry.entry_id)
            self._metrics.request_closed(request_id)

    def give_up_all(self) -> list[QueueEntry]:
        """Removes every request from the engine and closes its route without a word to its gateway
        or an acknowledgement (a peer resumes it for the same client); returns their entries."""
        entries = []
        for request_id, route in self._routes.items():
            self._scheduler.abort_request(request_id)
            route.span.end()
            self._metrics.request_closed(request_id)
            entries.append(route.entry)
        self._routes.clear()
        return entries
