"""The commands other threads hand the scheduler loop (``SchedulerLoop.submit``)."""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass

from pagedserve.engine.engine import SentPlan
from pagedserve.engine.messages import SequenceId
from pagedserve.services.common.pb import engine_pb2 as pb
from pagedserve.services.scheduler.queue_consumer import QueueEntry


@dataclass(frozen=True)
class ClusterView:
    """What the loop needs to know of the cluster, as just read from Redis.

    Attributes:
        workers: registrations of the workers this scheduler owns, by worker id.
        epochs: the lease epoch of every worker this scheduler owns (sent in every plan to it),
            also of those whose registration is missing now: a worker not here lost its lease.
        peers_have_workers: another live scheduler runs at least one worker (its registration
            announces blocks): requests this one cannot run may be handed off.
        read_at: when the read began, ``time.monotonic()`` seconds: the view holds every heartbeat
            a worker wrote before then (``WorkerMembership`` tells a dead worker's last beat from a
            live one's next by it).
        model_name: the model of the cluster's live workers, this scheduler's or a peer's ("" while
            none is registered): the label of its metrics before it owns a worker (a restarted
            scheduler resuming its requests counted them under "").
    """

    workers: Mapping[str, pb.WorkerRegistration]
    epochs: Mapping[str, int]
    peers_have_workers: bool
    read_at: float
    model_name: str


@dataclass(frozen=True)
class ClaimedEntries:
    """Requests taken over from another consumer of the group."""

    entries: tuple[QueueEntry, ...]


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
