"""The commands other threads hand the scheduler loop (``SchedulerLoop.submit``)."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

from pagedserve.engine.engine import SentPlan
from pagedserve.engine.messages import SequenceId
from services.common.pb import engine_pb2 as pb
from services.scheduler.cluster import ClaimedEntries, ClusterView
from services.scheduler.queue_consumer import QueueEntry


@dataclass(frozen=True)
class NewEntries:
    entries: tuple[QueueEntry, ...]


@dataclass(frozen=True)
class Abort:
    """Abort a request (all its samples); ``done`` gets whether this scheduler held it."""

    request_id: str
    done: Future


@dataclass(frozen=True)
class HeldRequests:
    """Which of ``request_ids`` this scheduler holds; ``done`` gets them as a list."""

    request_ids: tuple[str, ...]
    done: Future


@dataclass(frozen=True)
class AbortSample:
    """Abort one sample of a request (the others go on); ``done`` gets whether it was in flight."""

    seq_id: SequenceId
    done: Future


@dataclass(frozen=True)
class GatewayGone:
    """A gateway's output stream (subscription ``generation``) closed; unless a newer one is open,
    its requests are aborted unless it returns in time."""

    gateway_id: str
    generation: int


@dataclass(frozen=True)
class GatewayBack:
    gateway_id: str
    generation: int


@dataclass(frozen=True)
class StepDone:
    """A plan's answer came (or its call failed): the loop applies it."""

    sent: SentPlan


@dataclass(frozen=True)
class Resume:
    """A gateway's answer to a resume query; ``done`` gets whether the request was waiting for it,
    or the ``ValueError`` that makes the answer invalid."""

    message: pb.ResumeRequest
    done: Future


Command = (NewEntries | ClaimedEntries | Abort | AbortSample | HeldRequests | GatewayGone | GatewayBack | StepDone
           | ClusterView | Resume)
