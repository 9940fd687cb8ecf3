"""What a scheduler does with the requests it is handed: entries read from Redis, gateways'
aborts and resume answers, gateways that come and go. Its requests live in one ``RequestTable``."""

from __future__ import annotations

import logging
import time

from pagedserve.engine.messages import EngineRequest, RequestError, SequenceId
from pagedserve.engine.outputs import RequestOutput
from pagedserve.engine.request_errors import ErrorKind
from pagedserve.engine.engine import Engine
from pagedserve.services.common.convert import output_to_pb, request_from_pb
from pagedserve.services.common.pb import engine_pb2 as pb
from pagedserve.services.scheduler.commands import Resume
from pagedserve.services.scheduler.config import SchedulerServiceConfig
from pagedserve.services.scheduler.gateway_presence import GatewayPresence
from pagedserve.services.scheduler.gateway_streams import GatewayStreams
from pagedserve.services.scheduler.metrics import SchedulerMetrics
from pagedserve.services.scheduler.migration import resume_query, resumed_samples_from_pb
from pagedserve.services.scheduler.queue_consumer import Delivery, QueueEntry
from pagedserve.services.scheduler.redis_io import RedisWrites
from pagedserve.services.scheduler.request_table import ABORTED_UNREAD_KEEP_S, Phase, RequestTable

log = logging.getLogger("pagedserve.scheduler")


class RequestIntake:
    """Moves requests through the table's phases; runs on the scheduler loop's thread only.

    Args:
        config: the scheduler service's config (gateway grace, migration limit).
        engine: the step driver (requests go in through it: one with a structured output waits
            for its grammar) and its scheduler, which the running requests are in.
        table: the requests held.
        streams: the gateways' output queues.
        redis_writes: acknowledges and hands off stream entries (never blocks).
        metrics: the scheduler's series.
    """

    def __init__(self, config: SchedulerServiceConfig, engine: Engine, table: RequestTable,
                 streams: GatewayStreams, redis_writes: RedisWrites, metrics: SchedulerMetrics) -> None:
        self.config = config
        self.engine = engine
        self.scheduler = engine.scheduler
        self.table = table
        self.streams = streams
        self.redis_writes = redis_writes
        self.metrics = metrics
        self.gateways = GatewayPresence(config.gateway_grace_s)
        self._deliver = table.deliver

    def gateway_gone(self, gateway_id: str, generation: int) -> None:
        """A gateway's output stream closed (unless a newer one of it is open already)."""
        if self.streams.is_current(gateway_id, generation):
            self.gateways.gone(gateway_id)

    def gateway_back(self, gateway_id: str) -> None:
        """Starts the requests parked for a gateway that listens again; sends its resume queries again."""
        self.gateways.back(gateway_id)
        self.streams.keep(gateway_id)  # it may have subscribed just before its grace ran out
        for request_id in self.table.of_gateway(gateway_id, Phase.PARKED):
            row = self.table.remove(request_id)
            self._start(row.entry, row.request)
        queries = self.table.resume_queries(gateway_id)
        if queries.resume_queries:  # again: the gateway may have missed them while it reconnected
            self.streams.publish(gateway_id, queries)

    def drop_for_gone_gateways(self) -> None:
        """Drops the requests of gateways whose stream has been closed longer than the grace period."""
        now = time.monotonic()
        for gateway_id in self.gateways.expired():
            parked = self.table.of_gateway(gateway_id, Phase.PARKED)
            if parked:
                log.info("dropping %d request(s) of gateway %s, which never connected", len(parked), gateway_id)
            for request_id in [*parked, *self.table.of_gateway(gateway_id, Phase.AWAITING_RESUME)]:
                self.redis_writes.ack(self.table.remove(request_id).entry.entry_id)
            for request_id in self.table.of_gateway(gateway_id, Phase.IN_ENGINE):
                log.info("aborting %s: its gateway %s is gone", request_id, gateway_id)
                self.abort(request_id)
            self.streams.retire(gateway_id, now + self.config.gateway_grace_s)  # with the aborts' finals
        self.streams.drop_retired(now)
        self.table.forget_aborted_unread(self.config.gateway_grace_s + ABORTED_UNREAD_KEEP_S)

    def add(self, entry: QueueEntry) -> None:
        """Takes a stream entry read from Redis (new, claimed, handed off or read again)."""
        row = self.table.row(entry.request.request_id)
        if row is not None and row.phase is not Phase.ABORTED_UNREAD:  # in flight: its own entry read again
            if row.entry.entry_id != entry.entry_id:  # is kept; another entry of it (a replay) is acknowledged
                self.redis_writes.ack(entry.entry_id)
            return
        try:
            request = request_from_pb(entry.request)
        except ValueError as exc:  # a record no gateway of ours writes: drop it, keep serving
            log.error("dropping stream entry %r: %s", entry.entry_id, exc)
            self.redis_writes.ack(entry.entry_id)
            return
        if row is not None:  # its client gave up before we read it
            self.table.remove(request.request_id)
            self.redis_writes.ack(entry.entry_id)
        elif not self.gateways.is_live(entry.request.gateway_id):  # orphans cost nothing until it listens
            self.gateways.request_read(entry.request.gateway_id)
            self.table.park(entry, request)
        else:
            self._start(entry, request)

    def _start(self, entry: QueueEntry, request: EngineRequest) -> None:
        """Runs a request whose gateway listens; one taken over first asks its gateway what its
        client already received."""
        if entry.delivery is Delivery.REDELIVERED:
            self.table.await_resume(entry, request)
            self.streams.publish(entry.request.gateway_id, pb.TokenEventBatch(resume_queries=[resume_query(entry)]))
            return
        self.engine.add_request(self.table.enter_engine_now(entry, request))
        self._deliver([RequestOutput.taken(request.request_id)])

    def resume(self, command: Resume) -> None:
        """Continues a taken-over request after the tokens its client received; ends it instead
        when it moved more often than ``--migration-limit`` or the account does not fit it."""
        message = command.message
        row = self.table.row(message.request_id)
        if row is None or row.phase is not Phase.AWAITING_RESUME or row.gateway_id != message.gateway_id:
            command.done.set_result(False)
            return
        request = self.table.enter_engine(message.request_id)
        if message.num_migrations > self.config.migration_limit:
            command.done.set_result(True)
            self._fail(request.request_id, RequestError(ErrorKind.UNAVAILABLE, (
                f"the request moved {message.num_migrations} times between schedulers, more than "
                f"--migration-limit {self.config.migration_limit}; retry")))
            return
        try:
            self.engine.resume_request(request, resumed_samples_from_pb(message))
        except ValueError as exc:  # the gateway's account does not fit the request: it cannot go on exactly
            command.done.set_exception(exc)
            self._fail(request.request_id, RequestError(ErrorKind.INVALID_ARGUMENT, f"cannot resume the request: {exc}"))
            return
        command.done.set_result(True)
        self.metrics.request_migrated(len(request.prompt_token_ids) + sum(len(s.token_ids) for s in message.samples))
        self.table.close_if_done(request.request_id)  # every sample had finished: nothing to run

    def _fail(self, request_id: str, error: RequestError) -> None:
        """Ends a request that is not in the engine with ``error``."""
        self._deliver([RequestOutput.aborted(request_id, error)])

    def drop_unanswered_resumes(self) -> None:
        """Drops requests whose gateway did not answer the resume query, telling it (else it waits for ever)."""
        for entry in self.table.expired_resumes():
            request_id, gateway_id = entry.request.request_id, entry.request.gateway_id
            log.warning("dropping %s: its gateway %s did not answer the resume query", request_id, gateway_id)
            self.redis_writes.ack(entry.entry_id)
            error = RequestError(ErrorKind.UNAVAILABLE, "the request was taken over by another scheduler, which got no "
                                              "answer to its resume query in time; retry")
            output = RequestOutput.aborted(request_id, error)
            self.streams.publish(gateway_id, pb.TokenEventBatch(events=[output_to_pb(output)]))

    def abort(self, request_id: str) -> bool:
        """Aborts a request; its gateway gets the final ABORT outputs. Returns whether this
        scheduler held it."""
        row = self.table.row(request_id)
        if row is not None and row.phase in (Phase.PARKED, Phase.AWAITING_RESUME):  # its client is gone: nothing
            self.redis_writes.ack(self.table.remove(request_id).entry.entry_id)        # to run or resume
            return True
        outputs = self.scheduler.abort_request(request_id)
        if row is None:  # not read yet: its entry is acknowledged unread when it comes
            self.table.abort_unread(request_id)
        self._deliver(outputs)
        return bool(outputs)

    def held(self, request_ids: tuple[str, ...]) -> list[str]:
        """Those of ``request_ids`` this scheduler holds, in any phase but aborted before being read."""
        rows = ((request_id, self.table.row(request_id)) for request_id in request_ids)
        return [request_id for request_id, row in rows if row is not None and row.phase is not Phase.ABORTED_UNREAD]

    def abort_sample(self, seq_id: SequenceId) -> bool:
        """Aborts one sample of a request (the others go on); returns whether it was in flight."""
        outputs = self.scheduler.abort_sample(seq_id)
        self._deliver(outputs)
        return bool(outputs)
