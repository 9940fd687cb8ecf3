"""A scheduler loop without workers: waiting requests fail with UNAVAILABLE once they have waited
``--no-worker-timeout`` while no worker was up in the cluster, and not before."""

from __future__ import annotations

import threading
import time

import pytest

from pagedserve.services.common.pb import engine_pb2 as pb
from pagedserve.services.scheduler.commands import ClusterView, NewEntries
from pagedserve.services.scheduler.queue_consumer import Delivery
from tests.scheduler.test_loop_migration import Loop, entry, next_batch, view_without_workers

pytestmark = pytest.mark.timeout(30)


def test_waiting_requests_fail_when_the_last_worker_fails_and_no_cluster_view_follows():
    """A scheduler whose lease key was overwritten (anyone who can write to Redis) publishes no
    ClusterView while it waits for "the other" scheduler's lease to expire, so a worker dropped for
    a failed step is never admitted again. The loop noticed having no worker only in a ClusterView:
    the request then waited for a worker for ever, and its client hung to its own deadline (5 of 16
    in the re-attack of issue #20). Without a worker for ``no_worker_timeout_s``, it must fail with
    UNAVAILABLE."""

    with Loop(no_worker_timeout_s=1.0) as sched:
        _, events = sched.connect("gw")
        dead = pb.WorkerRegistration(worker_id="w", address="127.0.0.1:1", num_blocks=64, block_size=16,
                                     instance_id="i")  # nothing listens there: its first step fails
        sched.loop.submit(ClusterView({"w": dead}, {"w": 1}, False, time.monotonic(), "m"))
        sched.loop.submit(NewEntries((entry("r", "gw", Delivery.FIRST),)))
        final = []
        for batch in iter(lambda: next_batch(events, 15), None):
            final += [e for e in batch.events if e.request_id == "r" and e.finish_reason]
            if final:
                break
        assert final and final[0].finish_reason == pb.FINISH_REASON_ABORT
        assert final[0].error.kind == pb.ERROR_KIND_UNAVAILABLE


def test_a_scheduler_without_workers_beside_a_peer_with_one_does_not_fail_a_request_when_the_peer_restarts_it(
        monkeypatch):
    """CI, 2026-12-06 (`pagedserve up --schedulers 2 --workers 1`, the worker killed and started again): the
    scheduler that never had the worker read a request 0.7 s after the peer admitted the new worker, before its
    next ClusterView said so, and failed it at once with "no worker has been available for 30 s": its clock
    counted its own workers, not the cluster's (the worker had been gone 7 s). Expected: no failure while the
    cluster has been without workers for less than the timeout; the request is handed off once the peer
    announces its worker."""
    from pagedserve.services.scheduler import loop as loop_module

    monkeypatch.setattr(loop_module, "HANDOFF_AFTER_S", 0.2)
    with Loop(no_worker_timeout_s=1.0) as sched:
        _, events = sched.connect("gw")
        sched.loop.submit(view_without_workers(peers_have_workers=True))  # the peer runs the only worker
        threading.Event().wait(1.5)  # longer than the timeout: no worker of its own all along
        sched.loop.submit(view_without_workers(peers_have_workers=False))  # the worker killed
        sched.loop.submit(NewEntries((entry("r", "gw", Delivery.FIRST),)))  # read before the peer's news
        batches = list(iter(lambda: next_batch(events, 0.5), None))
        failed = [e for b in batches for e in b.events if e.finish_reason]
        assert not failed, "failed though the cluster lost its worker 0.5 s ago"
        sched.loop.submit(view_without_workers(peers_have_workers=True))  # the restarted worker, admitted by the peer
        while not sched.handed_off:
            threading.Event().wait(0.05)
        assert sched.handed_off == [b"r-0"]


def test_a_request_read_just_before_the_first_worker_is_admitted_gets_the_whole_timeout():
    """A test of the whole stack on a busy machine (a tensor-parallel worker with a remote rank took over 30 s to
    load), and an attack on a `pagedserve up` stack: the gateway sent a request once the scheduler's registration
    announced the new worker's blocks, and the loop read it before the ClusterView that admits that worker; the
    cluster had had no worker for longer than the timeout (since the start), so the request failed at once with
    "no worker has been available for 30 s", 4 ms before the worker was admitted. Expected: a request waits the
    whole timeout for a worker, then fails."""
    with Loop(no_worker_timeout_s=1.0) as sched:
        _, events = sched.connect("gw")
        threading.Event().wait(1.5)  # no worker since the start, longer than the timeout
        sched.loop.submit(NewEntries((entry("r", "gw", Delivery.FIRST),)))
        started = time.monotonic()
        final = []
        for batch in iter(lambda: next_batch(events, 15), None):
            final += [e for e in batch.events if e.request_id == "r" and e.finish_reason]
            if final:
                break
        waited = time.monotonic() - started
        assert final and final[0].error.kind == pb.ERROR_KIND_UNAVAILABLE
        assert 0.9 < waited < 5.0, f"failed after {waited:.2f} s; the timeout is 1 s"


def test_a_scheduler_without_workers_labels_its_metrics_with_the_clusters_model():
    """Attack (2026-12-07): a scheduler restarted after kill -9 resumed its requests before owning a worker and
    counted them under model_name="" (the model came from its own workers' registrations only)."""
    with Loop() as sched:
        sched.loop.submit(ClusterView({}, {}, True, time.monotonic(), "smol"))  # a peer's worker serves "smol"
        deadline = time.monotonic() + 5
        while sched.loop.model_name != "smol" and time.monotonic() < deadline:
            threading.Event().wait(0.02)
        assert sched.loop.model_name == "smol"
        sched.loop.submit(ClusterView({}, {}, False, time.monotonic(), ""))  # none registered a moment: kept
        threading.Event().wait(0.3)
        assert sched.loop.model_name == "smol"
