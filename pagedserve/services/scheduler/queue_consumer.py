"""Reads requests from the Redis stream with a consumer group (XREADGROUP), acknowledges finished ones.

An entry stays pending in the group until its request finishes, so a scheduler that restarts under
the same consumer name first re-reads what it had taken and not finished. An entry that does not
decode, or is not signed with the cluster token (``pagedserve.services.common.signed_records``), is dropped:
acknowledged, deleted and counted, wherever it is read (new, backlog, claimed from a peer, inbox).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

import redis
from google.protobuf.message import DecodeError

from pagedserve.services.common import redis_keys
from pagedserve.services.common.pb import engine_pb2 as pb
from pagedserve.services.common.signed_records import RecordCheck, RecordKind


class Delivery(enum.Enum):
    """How an entry reached this scheduler."""

    FIRST = "first"  # new on the stream: nothing ran for it yet
    REDELIVERED = "redelivered"  # read before (this scheduler's backlog after a restart, or taken over
    # from another): its client may have received tokens already, so it is resumed, not started


@dataclass(frozen=True)
class QueueEntry:
    """A request read from the stream, with the stream entry id to acknowledge later."""

    entry_id: bytes
    request: pb.QueuedRequest
    delivery: Delivery = Delivery.FIRST
    taken_at_us: int = 0  # for a redelivered entry: Redis's clock when this scheduler took it (its resume query's stamp)


def decode_entries(entries: list, delivery: Delivery, ack: Callable[[bytes], None], check: RecordCheck,
                   taken_at_us: int = 0) -> list[QueueEntry]:
    """Decodes ``(entry id, fields)`` pairs; entries deleted meanwhile, undecodable or not signed
    with the cluster token are acknowledged and skipped (the last two refused by ``check``). An
    entry queued again to be resumed (``redis_keys.RESUME_FIELD``) is ``Delivery.REDELIVERED``
    however it was read (``taken_at_us`` must then be Redis's clock at the read)."""
    decoded = []
    for entry_id, fields in entries:
        if not fields:  # deleted from the stream while pending (its client went away)
            ack(entry_id)
            continue
        request = pb.QueuedRequest()
        try:
            request.ParseFromString(fields[redis_keys.REQUEST_FIELD])
        except (KeyError, DecodeError):  # (DecodeError is no ValueError: it used to end the reader thread)
            check.refuse(RecordKind.QUEUED_REQUEST, "?", "undecodable")
            ack(entry_id)
            continue
        if not check.passes(request, request.gateway_id):
            ack(entry_id)
            continue
        resumed = redis_keys.RESUME_FIELD in fields
        decoded.append(QueueEntry(entry_id, request, Delivery.REDELIVERED if resumed else delivery, taken_at_us))
    return decoded


def to_resume(entries: list) -> bool:
    """Whether any of these ``(entry id, fields)`` pairs was queued again to be resumed."""
    return any(redis_keys.RESUME_FIELD in (fields or {}) for _, fields in entries)


_ACK = """
local pending = redis.pcall('XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1)
if pending.err then  -- no stream or no group (Redis restarted empty): nothing to acknowledge
  return 0
end
if #pending > 0 and pending[1][2] ~= ARGV[3] then
  return 0
end
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[1], ARGV[2])
return 1
"""
"""XACK + XDEL of one entry, unless another consumer holds it pending: a scheduler that lost its
lease (a pause, a partition) and then ends a request must not take the entry from the survivor that
resumed the request meanwhile (a second failure would lose it)."""


class RequestQueueConsumer:
    """One consumer of the scheduler group on the request stream.

    Args:
        client: a Redis client (bytes responses).
        consumer_name: stable across restarts of the same scheduler.
        check: verifies the entries read (``decode``).
    """

    def __init__(self, client: redis.Redis, consumer_name: str, check: RecordCheck) -> None:
        self._client = client
        self._consumer = consumer_name
        self._check = check
        self._backlog_cursor: bytes | None = b"0"  # where to continue reading our pending entries; None when done
        self._ack = client.register_script(_ACK)

    def ensure_group(self) -> None:
        """Creates the stream and the consumer group if they do not exist."""
        try:
            self._client.xgroup_create(redis_keys.REQUEST_STREAM, redis_keys.SCHEDULER_GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def reread_backlog(self) -> None:
        """Makes the next reads page through this consumer's pending entries again (as at start). An
        entry Redis moved to this consumer without the scheduler taking it (a read or claim whose reply
        was lost, and which redis-py retried; an error between a read and the hand-over to the loop)
        comes back ``Delivery.REDELIVERED`` and is resumed; the loop ignores the entries it holds."""
        self._backlog_cursor = b"0"

    def read(self, count: int, block_ms: int) -> list[QueueEntry]:
        """Returns up to ``count`` entries: first this consumer's unfinished backlog, then new ones.

        Blocks up to ``block_ms`` milliseconds for new entries. Entries that fail ``decode_entries``
        are acknowledged and skipped. Backlog entries are ``Delivery.REDELIVERED``.
        """
        if self._backlog_cursor is not None:  # pending entries come back on every read from an id: page once
            entries = self._xreadgroup(self._backlog_cursor, count, block_ms=None)
            if entries:
                self._backlog_cursor = entries[-1][0]
                return self.decode(entries, Delivery.REDELIVERED, self._redis_clock_us())
            self._backlog_cursor = None
        entries = self._xreadgroup(">", count, block_ms)
        return self.decode(entries, Delivery.FIRST, self._redis_clock_us() if to_resume(entries) else 0)

    def decode(self, entries: list, delivery: Delivery, taken_at_us: int = 0) -> list[QueueEntry]:
        """``decode_entries`` of ``(entry id, fields)`` pairs this consumer holds."""
        return decode_entries(entries, delivery, self.ack, self._check, taken_at_us)

    def _redis_clock_us(self) -> int:
        seconds, micros = self._client.time()
        return seconds * 1_000_000 + micros

    def _xreadgroup(self, start: bytes | str, count: int, block_ms: int | None) -> list:
        reply = self._client.xreadgroup(redis_keys.SCHEDULER_GROUP, self._consumer,
                                        {redis_keys.REQUEST_STREAM: start}, count=count, block=block_ms)
        return reply[0][1] if reply else []

    def ack(self, entry_id: bytes) -> None:
        """Marks an entry done and deletes it from the stream, unless another consumer holds it now
        (a peer took it over while this scheduler was cut off)."""
        self._ack(keys=[redis_keys.REQUEST_STREAM], args=[redis_keys.SCHEDULER_GROUP, entry_id, self._consumer])

    def length(self) -> int:
        """Entries in the request stream (queued or in flight: an entry is deleted when acknowledged)."""
        return self._client.xlen(redis_keys.REQUEST_STREAM)
