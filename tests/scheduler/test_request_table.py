"""The request table: each request held by a scheduler is in one phase, and leaves it the one way
that phase allows (exact acknowledgements, hand-offs and expiries)."""

from __future__ import annotations

from opentelemetry import trace

from pagedserve.engine.config import SchedulerConfig
from pagedserve.engine.messages import EngineRequest
from pagedserve.engine.outputs import RequestOutput
from pagedserve.engine.sampling_params import EngineSamplingParams
from pagedserve.engine.scheduler import Scheduler
from pagedserve.services.common.convert import request_from_pb, request_to_pb
from pagedserve.services.scheduler.gateway_streams import GatewayStreams
from pagedserve.services.scheduler.metrics import SchedulerMetrics
from pagedserve.services.scheduler.queue_consumer import Delivery, QueueEntry
from pagedserve.services.scheduler.request_table import RESUME_TIMEOUT_S, Phase, RequestTable


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def entry(request_id: str, gateway_id: str = "gw") -> QueueEntry:
    request = EngineRequest(request_id, (1, 2, 3), EngineSamplingParams(max_tokens=4), 0.0)
    return QueueEntry(f"{request_id}-0".encode(), request_to_pb(request, gateway_id), Delivery.FIRST)


def table() -> tuple[RequestTable, Scheduler, list[bytes], Clock, GatewayStreams]:
    scheduler = Scheduler(SchedulerConfig(block_size=4, max_num_seqs=4, max_num_batched_tokens=64))
    scheduler.add_worker("w", num_blocks=8)
    acked: list[bytes] = []
    clock = Clock()
    streams = GatewayStreams()
    metrics = SchedulerMetrics(lambda: (scheduler.stats(), "m"))
    return RequestTable(scheduler, streams, acked.append, metrics, trace.get_tracer("test"), clock), scheduler, \
        acked, clock, streams


def test_a_running_request_is_acknowledged_once_its_last_sample_leaves_the_engine():
    requests, scheduler, acked, _, streams = table()
    _, events = streams.subscribe("gw")
    e = entry("a")
    scheduler.add_request(requests.enter_engine_now(e, request_from_pb(e.request)))
    assert requests.row("a").phase is Phase.IN_ENGINE and requests.entry_id("a") == b"a-0"
    requests.deliver([RequestOutput.taken("a")])
    assert acked == [] and requests.row("a").phase is Phase.IN_ENGINE  # still in the engine
    requests.deliver(scheduler.abort_request("a"))
    assert acked == [b"a-0"] and requests.row("a") is None
    assert [len(events.get_nowait().events), len(events.get_nowait().events)] == [1, 1]


def test_parked_and_resumed_requests_leave_by_remove_or_run_never_through_the_engine():
    requests, _, acked, _, _ = table()
    for rid, hold in (("p", requests.park), ("r", requests.await_resume)):
        e = entry(rid)
        hold(e, request_from_pb(e.request))
    assert requests.of_gateway("gw", Phase.PARKED) == ["p"]
    assert requests.of_gateway("gw", Phase.AWAITING_RESUME) == ["r"]
    assert [q.request_id for q in requests.resume_queries("gw").resume_queries] == ["r"]
    assert requests.remove("p").entry.entry_id == b"p-0" and requests.row("p") is None
    request = requests.enter_engine("r")
    assert requests.row("r").phase is Phase.IN_ENGINE and request.prompt_token_ids == (1, 2, 3)
    assert acked == []


def test_an_abort_before_the_entry_is_read_holds_no_entry_and_expires():
    requests, _, _, clock, _ = table()
    requests.abort_unread("x")
    assert requests.row("x").phase is Phase.ABORTED_UNREAD and requests.entry_id("x") is None
    assert requests.give_up_all() == []  # nothing to hand off: no entry is held
    clock.now += 10
    requests.forget_aborted_unread(older_than_s=5)
    assert requests.row("x") is None


def test_give_up_all_returns_every_held_entry_and_empties_the_engine():
    requests, scheduler, acked, _, _ = table()
    for rid in ("a", "b"):
        e = entry(rid)
        scheduler.add_request(requests.enter_engine_now(e, request_from_pb(e.request)))
    e = entry("c")
    requests.await_resume(e, request_from_pb(e.request))
    assert sorted(e.entry_id for e in requests.give_up_all()) == [b"a-0", b"b-0", b"c-0"]
    assert not scheduler.has_request("a") and not scheduler.has_request("b") and acked == []


def test_a_request_awaiting_its_resume_expires_after_the_timeout():
    requests, _, _, clock, _ = table()
    e = entry("r")
    requests.await_resume(e, request_from_pb(e.request))
    clock.now += RESUME_TIMEOUT_S - 1
    assert requests.expired_resumes() == []
    clock.now += 2
    assert [x.entry_id for x in requests.expired_resumes()] == [b"r-0"] and requests.row("r") is None
