"""Request migration on the scheduler side: requests taken over from another scheduler (or from this
one's own backlog after a restart) wait here until their gateway says which tokens its client
already received (``Scheduler.Resume``); then they continue from there, so the client sees every
token once (request migration as NVIDIA Dynamo does it: resume from the tokens already delivered).
"""

from __future__ import annotations

from pagedserve.engine.messages import ResumedSample
from pagedserve.engine.sampling_checks import MAX_N
from pagedserve.services.common.pb import engine_pb2 as pb
from pagedserve.services.scheduler.queue_consumer import QueueEntry

MAX_RESUMED_SAMPLES = MAX_N
"""Most samples one Resume may list: a request has at most ``MAX_N`` (``n``, ``best_of``)."""


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
