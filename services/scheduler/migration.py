"""Request migration on the scheduler side: requests taken over from another scheduler (or from this
one's own backlog after a restart) wait here until their gateway says which tokens its client
already received (``Scheduler.Resume``); then they continue from there, so the client sees every
token once (request migration as NVIDIA Dynamo does it: resume from the tokens already delivered).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from pagedserve.engine.messages import ResumedSample
from services.common.pb import engine_pb2 as pb
from services.scheduler.queue_consumer import QueueEntry

RESUME_TIMEOUT_S = 30.0
"""How long a taken-over request waits for its gateway's answer before it is dropped, seconds
(the query is sent again each time the gateway's stream reconnects)."""

MAX_RESUMED_SAMPLES = 1024
"""Most samples one Resume may list (a request has at most this many, see request limits)."""


@dataclass
class _Waiting:
    entry: QueueEntry
    since: float


class PendingResumes:
    """Taken-over requests waiting for their gateway's Resume, by request id.

    Args:
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._waiting: dict[str, _Waiting] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._waiting

    def __len__(self) -> int:
        return len(self._waiting)

    def add(self, entry: QueueEntry) -> None:
        """Makes ``entry`` wait (its query is sent by the caller, see ``queries_for``)."""
        self._waiting.setdefault(entry.request.request_id, _Waiting(entry, self._clock()))

    def queries_for(self, gateway_id: str) -> pb.TokenEventBatch:
        """The resume queries of every request of ``gateway_id`` still waiting (empty batch if none)."""
        return pb.TokenEventBatch(resume_queries=[resume_query(w.entry) for w in self._waiting.values()
                                                  if w.entry.request.gateway_id == gateway_id])

    def entry_id(self, request_id: str) -> bytes | None:
        """The stream entry of a request waiting for its resume (None: not waiting)."""
        waiting = self._waiting.get(request_id)
        return None if waiting is None else waiting.entry.entry_id

    def take(self, request_id: str, gateway_id: str) -> QueueEntry | None:
        """Removes and returns the waiting entry of ``request_id`` if ``gateway_id`` queued it."""
        waiting = self._waiting.get(request_id)
        if waiting is None or waiting.entry.request.gateway_id != gateway_id:
            return None
        return self._waiting.pop(request_id).entry

    def drop(self, request_id: str) -> QueueEntry | None:
        """Removes ``request_id`` (its client is gone); returns its entry if it was waiting."""
        waiting = self._waiting.pop(request_id, None)
        return waiting.entry if waiting is not None else None

    def drop_gateway(self, gateway_id: str) -> list[QueueEntry]:
        """Removes every request of a gateway that went away; returns their entries."""
        ids = [r for r, w in self._waiting.items() if w.entry.request.gateway_id == gateway_id]
        return [self._waiting.pop(r).entry for r in ids]

    def drop_all(self) -> list[QueueEntry]:
        """Removes every waiting request (they are handed off); returns their entries."""
        entries = [w.entry for w in self._waiting.values()]
        self._waiting.clear()
        return entries

    def expired(self) -> list[QueueEntry]:
        """Removes and returns the requests that waited longer than ``RESUME_TIMEOUT_S``."""
        deadline = self._clock() - RESUME_TIMEOUT_S
        ids = [r for r, w in self._waiting.items() if w.since < deadline]
        return [self._waiting.pop(r).entry for r in ids]


def resume_query(entry: QueueEntry) -> pb.ResumeQuery:
    """The query asking the gateway of a taken-over ``entry`` what its client received, stamped
    with when this scheduler took it."""
    return pb.ResumeQuery(request_id=entry.request.request_id, taken_at_us=entry.taken_at_us)


def resumed_samples_from_pb(message: pb.ResumeRequest) -> list[ResumedSample]:
    """The samples of a Resume as engine messages (validated against the request by the engine).

    Raises:
        ValueError: more than ``MAX_RESUMED_SAMPLES`` samples.
    """
    if len(message.samples) > MAX_RESUMED_SAMPLES:
        raise ValueError(f"samples: at most {MAX_RESUMED_SAMPLES}, got {len(message.samples)}")
    return [ResumedSample(s.sample_index, tuple(s.token_ids), s.finished) for s in message.samples]
