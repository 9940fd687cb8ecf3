"""Every request a scheduler holds, by id, with its phase: the one owner of "is it in flight".

A request read from the Redis stream is in exactly one phase here until its entry is acknowledged
or handed off:

- ``PARKED``: read for a gateway that does not listen to this scheduler (yet); nothing runs for a
  client nobody would stream to. It runs when the gateway connects, and is dropped when the gateway
  stays away past the grace period.
- ``AWAITING_RESUME``: taken over from another scheduler (or this one's backlog after a restart);
  waits for its gateway's account of the tokens its client already received (request migration
  as NVIDIA Dynamo does it), at most ``RESUME_TIMEOUT_S``.
- ``IN_ENGINE``: handed to the engine (waiting in its queue or running); its outputs go to its gateway, and the
  row closes (span ended, entry acknowledged) once no sample of it is in flight in the engine.
- ``ABORTED_UNREAD``: its client gave up before this scheduler read its entry: the entry is
  acknowledged unread when it comes (no entry is held).

Each row keeps the request decoded once, when its entry was read.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from opentelemetry import trace

from pagedserve.engine.messages import EngineRequest
from pagedserve.engine.outputs import RequestOutput
from pagedserve.engine.scheduler import Scheduler
from pagedserve.services.common import telemetry
from pagedserve.services.common.convert import output_to_pb
from pagedserve.services.common.pb import engine_pb2 as pb
from pagedserve.services.scheduler.gateway_streams import GatewayStreams
from pagedserve.services.scheduler.metrics import SchedulerMetrics
from pagedserve.services.scheduler.migration import resume_query
from pagedserve.services.scheduler.queue_consumer import QueueEntry

RESUME_TIMEOUT_S = 30.0
"""How long a taken-over request waits for its gateway's answer before it is dropped, seconds
(the query is sent again each time the gateway's stream reconnects)."""

ABORTED_UNREAD_KEEP_S = 60.0
"""How long the id of a request aborted before its entry was read is kept beyond the gateways'
grace period, seconds (its entry comes within that unless it was lost)."""


class Phase(enum.Enum):
    PARKED = "parked"
    AWAITING_RESUME = "awaiting_resume"
    IN_ENGINE = "in_engine"
    ABORTED_UNREAD = "aborted_unread"


@dataclass
class Row:
    """One request. ``entry`` and ``request`` are set in every phase but ``ABORTED_UNREAD``;
    ``span`` only while ``IN_ENGINE``.

    Attributes:
        since: when it entered its phase, monotonic seconds.
    """

    phase: Phase
    since: float
    entry: QueueEntry | None = None
    request: EngineRequest | None = None
    span: trace.Span | None = None

    @property
    def gateway_id(self) -> str | None:
        """The gateway that queued it (None: no entry held)."""
        return None if self.entry is None else self.entry.request.gateway_id


class RequestTable:
    """The requests a scheduler holds and where each one's outputs go.

    Args:
        scheduler: the engine scheduler (asked whether a running request still has samples).
        streams: the gateways' output queues.
        ack: acknowledges a request's stream entry (never blocks).
        metrics: the scheduler's series.
        tracer: makes each running request's span.
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(self, scheduler: Scheduler, streams: GatewayStreams, ack: Callable[[bytes], None],
                 metrics: SchedulerMetrics, tracer: trace.Tracer, clock: Callable[[], float] = time.monotonic) -> None:
        self._scheduler = scheduler
        self._streams = streams
        self._ack = ack
        self._metrics = metrics
        self._tracer = tracer
        self._clock = clock
        self._rows: dict[str, Row] = {}

    # ---- questions -----------------------------------------------------------------------
    def row(self, request_id: str) -> Row | None:
        """The request's row; ``None`` when this scheduler does not hold it."""
        return self._rows.get(request_id)

    def entry_id(self, request_id: str) -> bytes | None:
        """The stream entry this scheduler holds for the request (None: it holds none)."""
        row = self._rows.get(request_id)
        return None if row is None or row.entry is None else row.entry.entry_id

    def in_engine_longer_than(self, request_ids: Iterable[str], seconds: float) -> list[str]:
        """Those of ``request_ids`` that have been running here (held by the engine) for more than ``seconds``."""
        return self._in_phase_longer_than(Phase.IN_ENGINE, seconds, request_ids)

    def of_gateway(self, gateway_id: str, phase: Phase) -> list[str]:
        """Ids of the requests of ``gateway_id`` in ``phase``."""
        return [r for r, row in self._rows.items() if row.gateway_id == gateway_id and row.phase is phase]

    def resume_queries(self, gateway_id: str) -> pb.TokenEventBatch:
        """The resume queries of every request of ``gateway_id`` awaiting its resume (empty batch if none)."""
        return pb.TokenEventBatch(resume_queries=[resume_query(self._rows[r].entry)
                                                  for r in self.of_gateway(gateway_id, Phase.AWAITING_RESUME)])

    # ---- phases --------------------------------------------------------------------------
    def park(self, entry: QueueEntry, request: EngineRequest) -> None:
        """Holds a request whose gateway does not listen."""
        self._rows[request.request_id] = Row(Phase.PARKED, self._clock(), entry, request)

    def await_resume(self, entry: QueueEntry, request: EngineRequest) -> None:
        """Holds a taken-over request until its gateway answers the resume query (the caller sends it)."""
        self._rows[request.request_id] = Row(Phase.AWAITING_RESUME, self._clock(), entry, request)

    def abort_unread(self, request_id: str) -> None:
        """Remembers that the client of a request not read yet gave up."""
        self._rows[request_id] = Row(Phase.ABORTED_UNREAD, self._clock())

    def enter_engine(self, request_id: str) -> EngineRequest:
        """Moves a parked or resumed request to ``IN_ENGINE`` and opens its span; returns the request
        carrying the span's context, for the engine.

        Raises:
            KeyError: the table holds no entry for ``request_id``.
        """
        row = self._rows[request_id]
        if row.request is None:
            raise KeyError(request_id)
        request = row.request
        row.span = self._tracer.start_span(
            "scheduler.request", context=telemetry.extract(request.trace_context),
            attributes={"request_id": request_id, "prompt_tokens": len(request.prompt_token_ids)},
        )
        row.phase, row.since = Phase.IN_ENGINE, self._clock()
        self._metrics.request_added(request_id)
        return replace(request, trace_context=telemetry.inject(trace.set_span_in_context(row.span)))

    def enter_engine_now(self, entry: QueueEntry, request: EngineRequest) -> EngineRequest:
        """Takes a request read now and hands it to the engine at once (see :meth:`enter_engine`)."""
        self.park(entry, request)
        return self.enter_engine(request.request_id)

    def remove(self, request_id: str) -> Row:
        """Forgets a request that is not running (its caller acknowledges or hands off its entry).

        Raises:
            KeyError: the table does not hold it, or it runs (it leaves through the engine).
        """
        if self._rows[request_id].phase is Phase.IN_ENGINE:
            raise KeyError(request_id)
        return self._rows.pop(request_id)

    # ---- outputs -------------------------------------------------------------------------
    def deliver(self, outputs: list[RequestOutput]) -> None:
        """Sends outputs of running requests to their gateways, one batch per gateway; closes the
        rows of requests that have no sample left in flight (after the whole batch, so that every
        sample's last output goes out)."""
        batches: dict[str, list[pb.TokenEvent]] = {}
        self._metrics.outputs(outputs)
        for output in outputs:
            row = self._rows.get(output.request_id)
            if row is None or row.phase is not Phase.IN_ENGINE:
                continue
            batches.setdefault(row.gateway_id, []).append(output_to_pb(output))
            if output.first_output_index == 0 and output.new_token_ids:
                row.span.add_event("first_token")
            if output.finished:
                row.span.add_event("sample_finished", {"finish_reason": output.finish_reason.value})
        for request_id in {o.request_id for o in outputs}:
            self.close_if_done(request_id)
        for gateway_id, events in batches.items():
            self._streams.publish(gateway_id, pb.TokenEventBatch(events=events))

    def close_if_done(self, request_id: str) -> None:
        """Closes a running request's row if none of its samples is in flight in the engine."""
        row = self._rows.get(request_id)
        if row is not None and row.phase is Phase.IN_ENGINE and not self._scheduler.has_request(request_id):
            del self._rows[request_id]
            row.span.end()
            self._ack(row.entry.entry_id)
            self._metrics.request_closed(request_id)

    # ---- bulk ----------------------------------------------------------------------------
    def give_up_all(self) -> list[QueueEntry]:
        """Forgets every request that holds an entry, without a word to its gateway or an
        acknowledgement (a peer resumes it for the same client): running ones leave the engine.
        Returns their entries."""
        entries = []
        for request_id, row in list(self._rows.items()):
            if row.entry is None:
                continue
            if row.phase is Phase.IN_ENGINE:
                self._scheduler.abort_request(request_id)
                row.span.end()
                self._metrics.request_closed(request_id)
            entries.append(self._rows.pop(request_id).entry)
        return entries

    def expired_resumes(self) -> list[QueueEntry]:
        """Removes and returns the requests that awaited their resume longer than ``RESUME_TIMEOUT_S``."""
        return self._expire(Phase.AWAITING_RESUME, RESUME_TIMEOUT_S)

    def forget_aborted_unread(self, older_than_s: float) -> None:
        """Forgets the aborted-unread ids older than ``older_than_s``."""
        self._expire(Phase.ABORTED_UNREAD, older_than_s)

    def _expire(self, phase: Phase, after_s: float) -> list[QueueEntry]:
        ids = self._in_phase_longer_than(phase, after_s, list(self._rows))
        return [row.entry for row in (self._rows.pop(r) for r in ids) if row.entry is not None]

    def _in_phase_longer_than(self, phase: Phase, seconds: float, request_ids: Iterable[str]) -> list[str]:
        """Those of ``request_ids`` held here in ``phase`` for more than ``seconds``."""
        deadline = self._clock() - seconds
        return [r for r in request_ids
                if (row := self._rows.get(r)) is not None and row.phase is phase and row.since < deadline]
