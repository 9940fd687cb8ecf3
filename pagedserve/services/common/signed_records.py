"""The records services read from Redis and act on, signed with the cluster token and checked on read.

Anyone who can write to Redis (a leaked password, a shared instance) could otherwise register a
worker or a scheduler (and be sent prompts, tokens and the cluster token), or queue a request in
another client's name (its tokens would reach that client). So every such record carries a
``signature``: HMAC-SHA256 under the cluster token of

    the message type's full name (e.g. ``pagedserve.engine.v1.QueuedRequest``) || 0x00 ||
    the message serialized deterministically with ``signature`` empty

(the type name binds the kind of record: a signature of one kind never verifies as another).
The identity a record speaks for is inside the signed bytes: a queued request's id and gateway id,
a registration's worker or scheduler id (which must also be the hash field it is stored under), so
a genuine record cannot be re-filed under another identity. A byte-for-byte copy of a genuine
record (a replay) still verifies; what it can do is in docs/architecture.md ("Trust in Redis").

A record that fails the check is dropped, counted (``pagedserve_redis_records_refused_total{kind}``
in the process that read it) and logged once per kind and source, never once per read.

The prefix index publishes keyed digests of the engine's block hashes (``BlockDigestKey``): plain
SHA-256 block hashes would let a reader of Redis confirm a guess of a cached prompt.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import logging
from collections.abc import Callable, Mapping
from typing import Generic, TypeVar

from google.protobuf.message import DecodeError

from pagedserve.services.common.pb import engine_pb2 as pb

log = logging.getLogger("pagedserve")


class RecordKind(enum.Enum):
    """The kinds of signed records (the value is the metric label)."""

    WORKER_REGISTRATION = "worker_registration"
    SCHEDULER_REGISTRATION = "scheduler_registration"
    QUEUED_REQUEST = "queued_request"


SignedRecord = pb.WorkerRegistration | pb.SchedulerRegistration | pb.QueuedRequest
R = TypeVar("R", pb.WorkerRegistration, pb.SchedulerRegistration, pb.QueuedRequest)

_KIND_OF = {pb.WorkerRegistration: RecordKind.WORKER_REGISTRATION,
            pb.SchedulerRegistration: RecordKind.SCHEDULER_REGISTRATION,
            pb.QueuedRequest: RecordKind.QUEUED_REQUEST}


def record_kind(record: SignedRecord) -> RecordKind:
    return _KIND_OF[type(record)]


def _mac(record: SignedRecord, cluster_token: str) -> bytes:
    unsigned = type(record)()
    unsigned.CopyFrom(record)
    unsigned.ClearField("signature")
    signed = record.DESCRIPTOR.full_name.encode() + b"\0" + unsigned.SerializeToString(deterministic=True)
    return hmac.new(cluster_token.encode(), signed, hashlib.sha256).digest()


def sign_record(record: SignedRecord, cluster_token: str) -> None:
    """Sets ``record.signature`` (see the module docstring)."""
    record.signature = _mac(record, cluster_token)


def record_is_signed(record: SignedRecord, cluster_token: str) -> bool:
    """Whether ``record`` was signed with ``cluster_token`` (compared in constant time)."""
    return hmac.compare_digest(record.signature, _mac(record, cluster_token))


MAX_SOURCES_LOGGED = 1024
"""Most (kind, source) pairs whose refusal is remembered as logged (then nothing more is logged)."""

MAX_SOURCE_CHARS = 80
"""A source is cut to this many characters in the log (it is chosen by whoever wrote the record)."""


class RecordCheck:
    """Verifies the records one process reads from Redis, and signs the ones it writes.

    Args:
        cluster_token: the secret shared by the cluster's services.
        on_refused: called with the kind of every refused record (the process's counter).
    """

    def __init__(self, cluster_token: str, on_refused: Callable[[RecordKind], None] = lambda kind: None) -> None:
        self._token = cluster_token
        self._on_refused = on_refused
        self._logged: set[tuple[RecordKind, str]] = set()

    def sign(self, record: SignedRecord) -> bytes:
        """Signs ``record`` and returns it serialized, ready to be written to Redis."""
        sign_record(record, self._token)
        return record.SerializeToString()

    def passes(self, record: SignedRecord, source: str) -> bool:
        """Whether ``record`` is signed with the cluster token; if not it is refused (see ``refuse``)."""
        if record_is_signed(record, self._token):
            return True
        self.refuse(record_kind(record), source, "not signed with this cluster token")
        return False

    def refuse(self, kind: RecordKind, source: str, why: str) -> None:
        """Counts a refused record; logs it unless one of this kind and source was logged already.

        Args:
            source: what the record claims to come from or stands for (a gateway or scheduler id,
                a hash field), for the reader of the log.
            why: what is wrong with it.
        """
        self._on_refused(kind)
        source = source[:MAX_SOURCE_CHARS]
        if (kind, source) in self._logged or len(self._logged) >= MAX_SOURCES_LOGGED:
            return
        self._logged.add((kind, source))
        log.warning("ignoring a %s from Redis (%s: %r): %s; a service with another cluster token, or someone "
                    "writing to Redis (logged once per source)", kind.value.replace("_", " "),
                    _SOURCE_NAMES[kind], source, why)


_SOURCE_NAMES = {RecordKind.WORKER_REGISTRATION: "hash field", RecordKind.SCHEDULER_REGISTRATION: "hash field",
                 RecordKind.QUEUED_REQUEST: "gateway"}


class SignedHash(Generic[R]):
    """The verified records of one Redis hash whose fields are the records' ids; each value is
    decoded and checked once (again only when it changes), so a forged entry that stays is refused,
    counted and logged once, not at every read.

    Args:
        record_type: the message type of the values.
        check: verifies them.
        identity: a record's id, which must be the field it is stored under.
    """

    def __init__(self, record_type: type[R], check: RecordCheck, identity: Callable[[R], str]) -> None:
        self._type = record_type
        self._check = check
        self._identity = identity
        self._checked: dict[bytes, tuple[bytes, R | None]] = {}  # field -> (value, verified record)

    def verified(self, raw: Mapping[bytes, bytes]) -> dict[str, R]:
        """The verified records of ``raw`` (the hash as HGETALL returns it) by id."""
        checked = {}
        for field, value in raw.items():
            known = self._checked.get(field)
            if known is None or known[0] != value:
                known = (value, self._verify(field, value))
            checked[field] = known
        self._checked = checked
        return {self._identity(record): record for _, record in checked.values() if record is not None}

    def _verify(self, field: bytes, value: bytes) -> R | None:
        record = self._type()
        source = field.decode(errors="replace")
        try:
            record.ParseFromString(value)
        except DecodeError:
            self._check.refuse(record_kind(record), source, "undecodable")
            return None
        if not self._check.passes(record, source):
            return None
        if self._identity(record).encode() != field:
            self._check.refuse(record_kind(record), source, f"stored under another id than its own "
                                                            f"({self._identity(record)[:MAX_SOURCE_CHARS]!r})")
            return None
        return record


_PREFIX_INDEX_DOMAIN = b"pagedserve.prefix-index\0"


class BlockDigestKey:
    """Keys the engine's block hashes for the shared prefix index: HMAC-SHA256 under the cluster
    token of a domain tag and the block's digest (a hash chained over the whole prefix and the
    request's cache salt, ``pagedserve.engine.block_hash``). Without the token, a reader of Redis
    cannot compute the published value of a prompt it guesses."""

    def __init__(self, cluster_token: str) -> None:
        self._base = hmac.new(cluster_token.encode(), _PREFIX_INDEX_DOMAIN, hashlib.sha256)

    def __call__(self, digest: bytes) -> bytes:
        mac = self._base.copy()
        mac.update(digest)
        return mac.digest()
