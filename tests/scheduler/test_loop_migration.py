"""Review of issue #13 (several schedulers): the scheduler loop's side of request migration, run on
its own thread without workers, Redis or gRPC (acknowledgements and hand-offs are recorded)."""

from __future__ import annotations

import queue
import threading
import time

import pytest
from opentelemetry import trace

from pagedserve.engine.messages import EngineRequest
from pagedserve.engine.sampling_params import EngineSamplingParams
from pagedserve.engine.scheduler import Scheduler
from pagedserve.services.common.convert import request_to_pb
from pagedserve.services.common.pb import engine_pb2 as pb
from pagedserve.services.scheduler import request_table
from pagedserve.services.scheduler.commands import ClaimedEntries, ClusterView, GatewayBack, GatewayGone, NewEntries
from pagedserve.services.scheduler.config import SchedulerServiceConfig
from pagedserve.services.scheduler.loop import SchedulerLoop
from pagedserve.services.scheduler.queue_consumer import Delivery, QueueEntry
from pagedserve.services.scheduler.redis_io import RedisWrites

pytestmark = pytest.mark.timeout(30)


class Loop:
    """A SchedulerLoop running on a thread; what it acknowledged is in ``acked``."""

    def __init__(self, **config) -> None:
        self.acked: list[bytes] = []
        self.handed_off: list[bytes] = []
        config = SchedulerServiceConfig(redis_url="redis://unused", cluster_token="t" * 16, **config)
        writes = RedisWrites(self.acked.append, self._hand_off)
        self.loop = SchedulerLoop(config, Scheduler(config.policy), writes, trace.get_tracer("test"), lambda ready: None)
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self.loop.run, args=(self.stop,), daemon=True),
                        threading.Thread(target=writes.run, args=(self.stop,), daemon=True)]

    def _hand_off(self, entries: list[QueueEntry]) -> int:
        self.handed_off += [e.entry_id for e in entries]
        return 0

    def __enter__(self) -> Loop:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=5)
        assert self.loop.error is None

    def connect(self, gateway_id: str) -> tuple[int, queue.SimpleQueue]:
        """A gateway's StreamOutputs call, as ``SchedulerServicer.StreamOutputs`` opens it."""
        generation, events = self.loop.streams.subscribe(gateway_id)
        self.loop.submit(GatewayBack(gateway_id, generation))
        return generation, events


def entry(request_id: str, gateway_id: str, delivery: Delivery, n: int = 1) -> QueueEntry:
    request = EngineRequest(request_id, (1, 2, 3), EngineSamplingParams(max_tokens=8, n=n), 0.0)
    return QueueEntry(f"{request_id}-0".encode(), request_to_pb(request, gateway_id), delivery)


def next_batch(events: queue.SimpleQueue, timeout_s: float) -> pb.TokenEventBatch | None:
    try:
        return events.get(timeout=timeout_s)
    except queue.Empty:
        return None


def view_without_workers(peers_have_workers: bool) -> ClusterView:
    return ClusterView({}, {}, peers_have_workers, read_at=time.monotonic(), model_name="")


def test_a_request_dropped_for_an_unanswered_resume_query_ends_at_its_gateway(monkeypatch):
    """A taken-over request whose gateway did not answer the resume query in time is dropped (its
    entry acknowledged). The gateway, which made this scheduler the request's owner when the query
    arrived (and whose stream to it stays up), must hear that the request ended: otherwise its
    client waits forever (``unreachable_for_s`` stays 0, nothing else ever ends the request).

    How the gateway misses the deadline without being gone: its answer is sent only when the
    request's generator reaches the query, i.e. when the client reads (a client that stops reading
    for RESUME_TIMEOUT_S), or its one Resume call failed while the stream stayed up (the query is
    sent again only when the stream reconnects)."""
    monkeypatch.setattr(request_table, "RESUME_TIMEOUT_S", 0.3)
    with Loop() as sched:
        _, events = sched.connect("gw")
        sched.loop.submit(NewEntries((entry("r", "gw", Delivery.REDELIVERED),)))
        query = next_batch(events, 5)
        assert query is not None and [q.request_id for q in query.resume_queries] == ["r"]
        while b"r-0" not in sched.acked:  # dropped after RESUME_TIMEOUT_S
            threading.Event().wait(0.05)
        final = [e for b in iter(lambda: next_batch(events, 0.5), None) for e in b.events if e.request_id == "r"]
        assert final and final[-1].finish_reason == pb.FINISH_REASON_ABORT, \
            "the gateway was never told that its request was dropped: its client hangs"


def dropped_for_its_absence(sched: Loop) -> int:
    """Connects gateway ``gw``, runs a request of it, closes its stream and waits until the request is
    dropped after the grace period; returns the stream's generation."""
    generation, events = sched.connect("gw")
    sched.loop.submit(NewEntries((entry("r", "gw", Delivery.FIRST),)))
    taken = next_batch(events, 5)
    assert taken is not None and [(e.request_id, e.kind) for e in taken.events] == [("r", pb.TOKEN_EVENT_KIND_TAKEN)]
    sched.loop.submit(GatewayGone("gw", generation))
    while b"r-0" not in sched.acked:  # aborted after the grace period
        threading.Event().wait(0.02)
    return generation


def test_a_gateway_back_just_after_its_grace_gets_the_finals_of_its_dropped_requests():
    """The gateway's own grace runs on its clock: it may reconnect when this scheduler has just
    dropped its requests, and must then hear that they ended (it would wait for them for ever)."""
    with Loop(gateway_grace_s=1.0) as sched:
        dropped_for_its_absence(sched)
        _, events = sched.connect("gw")
        final = next_batch(events, 5)
        assert final is not None and [(e.request_id, e.finish_reason) for e in final.events] == [
            ("r", pb.FINISH_REASON_ABORT)]


def test_no_output_queue_is_kept_for_a_gateway_gone_for_good():
    """The queue of a gateway whose requests were dropped for its absence goes one more grace period
    later (gateway ids are new at every gateway start: every gateway that ever died would hold one)."""
    with Loop(gateway_grace_s=0.2) as sched:
        generation = dropped_for_its_absence(sched)
        deadline = time.monotonic() + 5
        while sched.loop.streams.is_current("gw", generation) and time.monotonic() < deadline:
            threading.Event().wait(0.02)
        _, stale = sched.loop.streams.subscribe("gw")  # a later gateway under that id (or a leak check)
        assert stale.empty(), "the dropped requests' outputs were kept for the gone gateway"


def test_a_gateway_that_reconnects_as_its_grace_runs_out_gets_the_finals_and_keeps_its_queue():
    """Its new stream's GatewayBack is queued behind the loop's drop of its requests (one loop pass
    stepped by hand): the finals go to the new stream, which stays current and is not retired."""
    config = SchedulerServiceConfig(redis_url="redis://unused", cluster_token="t" * 16, gateway_grace_s=0.2)
    loop = SchedulerLoop(config, Scheduler(config.policy), RedisWrites(lambda e: None, lambda e: 0),
                         trace.get_tracer("test"), lambda ready: None)

    def one_pass() -> None:  # SchedulerLoop.run's order
        loop.requests.drop_for_gone_gateways()
        loop._dispatch()
        loop._handle_commands(wait_s=0.01)

    first, _ = loop.streams.subscribe("gw")
    loop.submit(GatewayBack("gw", first))
    loop.submit(NewEntries((entry("r", "gw", Delivery.FIRST),)))
    one_pass()
    loop.submit(GatewayGone("gw", first))
    one_pass()
    time.sleep(0.25)  # the grace runs out as the gateway reconnects
    second, events = loop.streams.subscribe("gw")
    loop.submit(GatewayBack("gw", second))
    one_pass()
    finals = []
    while not events.empty():
        finals += [(e.request_id, e.finish_reason) for e in events.get_nowait().events if e.finish_reason]
    assert finals == [("r", pb.FINISH_REASON_ABORT)]
    loop.streams.drop_retired(time.monotonic() + 60)
    assert loop.streams.is_current("gw", second)


def test_a_sample_abort_while_waiting_for_the_resume_does_not_drop_the_request_later(monkeypatch):
    """The gateway makes a scheduler the owner as soon as its resume query arrives, and then
    processes the old owner's outputs queued before the query: a stop string matched there sends
    this scheduler Abort(request, sample i) while the request waits for its Resume. The loop finds
    nothing to abort and records an *early abort of the whole request*. The request then resumes and
    runs; when its entry is added again within the next minute (handed off without workers, then
    claimed back once a worker returned), the early abort swallows it: the entry is acknowledged,
    no resume query goes out, and the gateway (owner: this scheduler, stream up) waits for ever."""
    from concurrent.futures import Future

    from pagedserve.services.scheduler import loop as loop_module
    from pagedserve.engine.messages import SequenceId
    from pagedserve.services.scheduler.commands import AbortSample, Resume

    monkeypatch.setattr(loop_module, "HANDOFF_AFTER_S", 0.2)
    with Loop() as sched:
        _, events = sched.connect("gw")
        taken_over = entry("r", "gw", Delivery.REDELIVERED, n=2)
        sched.loop.submit(NewEntries((taken_over,)))
        assert [q.request_id for q in next_batch(events, 5).resume_queries] == ["r"]
        aborted: Future = Future()
        sched.loop.submit(AbortSample(SequenceId("r", 1), aborted))  # a stop string matched on sample 1 (nothing runs yet)
        assert aborted.result(5) is False
        resumed: Future = Future()
        samples = [pb.ResumedSample(sample_index=0, token_ids=[5]), pb.ResumedSample(sample_index=1, token_ids=[6],
                                                                                     finished=True)]
        sched.loop.submit(Resume(pb.ResumeRequest(request_id="r", gateway_id="gw", num_migrations=1, samples=samples),
                                 resumed))
        assert resumed.result(5) is True
        sched.loop.submit(view_without_workers(peers_have_workers=True))  # no worker here, a peer has one
        while not sched.handed_off:
            threading.Event().wait(0.05)
        assert sched.handed_off == [b"r-0"]
        sched.loop.submit(ClaimedEntries((taken_over,)))  # claimed back (its worker is admitted again)
        query = next_batch(events, 2)
        assert query is not None and [q.request_id for q in query.resume_queries] == ["r"], \
            f"the request was dropped silently (acknowledged: {sched.acked})"


def test_a_resume_query_withdrawn_while_its_gateway_was_away_is_not_delivered_when_it_returns(monkeypatch):
    """A query waits in the gateway's queue while its stream is down; meanwhile the request is handed
    off (no worker here) and a peer resumes it for the gateway. When the gateway's stream comes back,
    the new subscription takes over the old queue, stale query included: the gateway then makes
    this scheduler the owner again, drops the peer's tokens and aborts it there, and waits for ever
    (this scheduler answers the Resume with found=False). Queries of requests still waiting are
    sent again on every reconnect anyway (GatewayBack), so the queued ones need not be carried over."""
    from pagedserve.services.scheduler import loop as loop_module

    monkeypatch.setattr(loop_module, "HANDOFF_AFTER_S", 0.2)
    with Loop() as sched:
        generation, _ = sched.connect("gw")
        sched.loop.submit(NewEntries((entry("r", "gw", Delivery.REDELIVERED),)))
        sched.loop.submit(GatewayGone("gw", generation))  # the stream breaks before the query went out
        sched.loop.submit(view_without_workers(peers_have_workers=True))
        while not sched.handed_off:
            threading.Event().wait(0.05)
        _, events = sched.connect("gw")  # ... and comes back after the hand-off
        stale = [q.request_id for b in iter(lambda: next_batch(events, 0.5), None) for q in b.resume_queries]
        assert stale == [], "a resume query for a request handed off meanwhile reached the gateway"


def test_a_second_entry_of_a_request_in_flight_is_acknowledged_and_its_own_is_kept():
    """Issue #20's attack run: byte copies of a queued request (a replay by a Redis writer, or the
    gateway queuing again an entry it thought lost) were ignored while the request ran, but never
    acknowledged: 1,425 of 1,495 copies stayed pending in Redis for ever. Its own entry read again
    (after a reconnect) must stay pending: it is the request's durability."""
    with Loop() as sched:
        _, events = sched.connect("gw")
        sched.loop.submit(NewEntries((entry("r", "gw", Delivery.FIRST),)))
        assert next_batch(events, 5) is not None  # taken
        copy = QueueEntry(b"r-1", entry("r", "gw", Delivery.FIRST).request)
        sched.loop.submit(NewEntries((entry("r", "gw", Delivery.FIRST), copy)))
        while b"r-1" not in sched.acked:
            threading.Event().wait(0.05)
        assert b"r-0" not in sched.acked
