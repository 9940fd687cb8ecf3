"""WorkerMembership: failed steps reset and re-admit, restarts by instance id, registration gaps."""

from __future__ import annotations

from pagedserve.engine.config import SchedulerConfig
from pagedserve.engine.messages import EngineRequest, SequenceId
from pagedserve.engine.request_errors import ErrorKind
from pagedserve.engine.sampling_params import EngineSamplingParams
from pagedserve.engine.scheduler import Scheduler
from pagedserve.engine.spec_decode.config import SpeculativeConfig
from pagedserve.services.common.pb import engine_pb2 as pb
from pagedserve.services.scheduler.commands import ClusterView
from pagedserve.services.scheduler.membership import WorkerMembership


class Connections:
    """Records what the membership asks of the executor (the real one opens gRPC channels)."""

    def __init__(self) -> None:
        self.open: dict[str, str] = {}
        self.epochs: dict[str, int] = {}

    def add_worker(self, worker_id: str, address: str, lease_epoch: int) -> None:
        assert worker_id not in self.open
        self.open[worker_id] = address
        self.epochs[worker_id] = lease_epoch

    def remove_worker(self, worker_id: str) -> None:
        self.open.pop(worker_id, None)


class AllOwned(dict):
    """The epochs of a scheduler that owns every worker, each under lease epoch 1."""

    def __contains__(self, worker_id) -> bool:
        return True

    def __missing__(self, worker_id) -> int:
        return 1


EPOCH_1 = AllOwned()


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def reg(worker_id: str, instance: str = "i1", blocks: int = 8, block_size: int = 16,
        heartbeat: int = 1, num_speculative_tokens: int = 0) -> pb.WorkerRegistration:
    return pb.WorkerRegistration(worker_id=worker_id, address=f"{worker_id}:1", num_blocks=blocks,
                                 block_size=block_size, instance_id=instance, heartbeat=heartbeat,
                                 num_speculative_tokens=num_speculative_tokens)


def view(clock: Clock, live: dict[str, pb.WorkerRegistration], epochs=EPOCH_1) -> ClusterView:
    """What the cluster thread hands the loop, read now."""
    return ClusterView(live, epochs, peers_have_workers=False, read_at=clock.now, model_name="m")


def make(speculative: SpeculativeConfig = SpeculativeConfig()):
    scheduler, connections, clock = Scheduler(SchedulerConfig(), speculative), Connections(), Clock()
    return scheduler, connections, clock, WorkerMembership(scheduler, connections, gone_after_s=5.0, clock=clock)


def test_a_failed_step_resets_the_worker_and_readmits_it_after_a_backoff():
    scheduler, connections, clock, members = make()
    members.sync(view(clock, {"w": reg("w")}))
    scheduler.add_request(EngineRequest("r", (1, 2, 3), EngineSamplingParams(max_tokens=4), 0.0))
    plan = scheduler.schedule(["w"]).plans["w"]
    members.step_failed("w", "DEADLINE_EXCEEDED")
    assert scheduler.worker_ids == [] and connections.open == {}
    assert scheduler.waiting_requests() == ["r"]  # requeued, to be recomputed
    members.sync(view(clock, {"w": reg("w", heartbeat=2)}))
    assert scheduler.worker_ids == []  # still backing off
    clock.now += 1.01
    members.sync(view(clock, {"w": reg("w", heartbeat=3)}))  # it beat again
    assert scheduler.worker_ids == ["w"]
    again = scheduler.schedule(["w"]).plans["w"]
    assert again.session_id != plan.session_id  # the worker drops what it held
    assert [n.seq_id for n in again.new_requests] == [SequenceId("r")] and again.new_requests[0].num_computed_tokens == 0


def test_backoff_doubles_while_a_worker_keeps_failing_and_resets_after_success():
    scheduler, _, clock, members = make()
    delays, beats = [], iter(range(1, 1000))
    for _ in range(3):
        members.sync(view(clock, {"w": reg("w", heartbeat=next(beats))}))
        start = clock.now
        members.step_failed("w", "UNAVAILABLE")
        while not scheduler.worker_ids:
            clock.now += 0.25
            members.sync(view(clock, {"w": reg("w", heartbeat=next(beats))}))
        delays.append(clock.now - start)
    assert delays == [1.0, 2.0, 4.0]
    members.step_succeeded("w")
    start = clock.now
    members.step_failed("w", "UNAVAILABLE")
    members.sync(view(clock, {"w": reg("w", heartbeat=next(beats))}))
    clock.now += 1.0
    members.sync(view(clock, {"w": reg("w", heartbeat=next(beats))}))
    assert scheduler.worker_ids == ["w"] and clock.now - start == 1.0


def test_a_worker_whose_heartbeat_stopped_is_not_admitted_again_until_it_beats():
    """A hung worker (SIGSTOP, swapping) keeps its registration until the heartbeat key expires;
    sending it plans would only time out again, costing its requests their worker losses."""
    scheduler, connections, clock, members = make()
    members.sync(view(clock, {"w": reg("w", heartbeat=7)}))
    members.step_failed("w", "DEADLINE_EXCEEDED")
    for _ in range(4):
        clock.now += 10.0  # long past the back-off
        members.sync(view(clock, {"w": reg("w", heartbeat=7)}))
        assert scheduler.worker_ids == [] and connections.open == {}
    members.sync(view(clock, {"w": reg("w", heartbeat=8)}))
    assert scheduler.worker_ids == ["w"]


def test_a_beat_a_worker_wrote_just_before_it_was_killed_does_not_admit_it_again():
    """CI, test_kill_the_only_worker_and_start_another: the worker beat between two views and was
    killed; that last beat, first seen after the failure, read as "it beats again", and the dead
    instance was admitted, failed at once (connection refused) and cost a request a worker loss."""
    scheduler, _, clock, members = make()
    members.sync(view(clock, {"w": reg("w", heartbeat=5)}))
    stale = view(clock, {"w": reg("w", heartbeat=5)})  # read before the failure, handed over after it
    clock.now += 0.3  # meanwhile the worker wrote beat 6 and was killed
    members.step_failed("w", "UNAVAILABLE")
    members.sync(stale)
    for _ in range(4):
        clock.now += 0.5
        members.sync(view(clock, {"w": reg("w", heartbeat=6)}))  # until its registration expires
        assert scheduler.worker_ids == []


def test_a_restarted_worker_is_admitted_after_a_failure_without_waiting_for_a_higher_beat():
    scheduler, _, clock, members = make()
    members.sync(view(clock, {"w": reg("w", heartbeat=40)}))
    members.step_failed("w", "UNAVAILABLE")  # it crashed; its new instance counts beats from 1
    clock.now += 1.0
    members.sync(view(clock, {"w": reg("w", "i2", heartbeat=1)}))
    assert scheduler.worker_ids == ["w"]


def test_a_restarted_worker_is_reset_by_its_new_instance_id():
    scheduler, connections, clock, members = make()
    members.sync(view(clock, {"w": reg("w", "i1")}))
    first = scheduler.schedule(["w"])  # nothing to do: no plan
    assert first.plans == {}
    session = scheduler.block_manager("w")
    members.sync(view(clock, {"w": reg("w", "i2")}))
    assert scheduler.worker_ids == ["w"] and scheduler.block_manager("w") is not session
    assert connections.open == {"w": "w:1"}


def test_a_short_registration_gap_changes_nothing_a_long_one_drops_the_worker():
    scheduler, _, clock, members = make()
    members.sync(view(clock, {"w": reg("w"), "v": reg("v")}))
    manager = scheduler.block_manager("w")
    members.sync(view(clock, {"v": reg("v")}))  # Redis restarted empty: w registers again within a second
    clock.now += 1.0
    members.sync(view(clock, {"w": reg("w"), "v": reg("v")}))
    assert sorted(scheduler.worker_ids) == ["v", "w"] and scheduler.block_manager("w") is manager
    members.sync(view(clock, {"v": reg("v")}))
    clock.now += 5.5
    members.sync(view(clock, {"v": reg("v")}))
    assert scheduler.worker_ids == ["v"]


def test_a_worker_with_another_block_size_is_not_admitted():
    scheduler, connections, clock, members = make()
    members.sync(view(clock, {"w": reg("w", block_size=32)}))
    assert scheduler.worker_ids == [] and connections.open == {}
    members.sync(view(clock, {"w": reg("w", "i2", block_size=16)}))  # restarted with the right size
    assert scheduler.worker_ids == ["w"]


def test_a_worker_that_speculates_otherwise_than_the_scheduler_is_not_admitted(caplog):
    """The scheduler reserves slots for k drafts; a worker must draft with the same k (0: neither speculates)."""
    scheduler, connections, clock, members = make(SpeculativeConfig(method="ngram", num_speculative_tokens=3,
                                                                    control="fixed"))
    members.sync(view(clock, {"w": reg("w"), "v": reg("v", num_speculative_tokens=4)}))
    assert scheduler.worker_ids == [] and connections.open == {}
    assert "worker w verifies 0 draft tokens per step, the scheduler reserves slots for 3" in caplog.text
    members.sync(view(clock, {"w": reg("w", "i2", num_speculative_tokens=3)}))  # restarted with the scheduler's k
    assert scheduler.worker_ids == ["w"]
    _, _, clock, plain = make()
    plain.sync(view(clock, {"u": reg("u", num_speculative_tokens=3)}))
    assert plain.worker_ids == []


def test_a_request_that_loses_three_workers_ends_with_unavailable():
    """Nothing hangs: a request whose workers keep failing (a poison request) ends after three losses."""
    scheduler, _, clock, members = make()
    scheduler.add_request(EngineRequest("poison", (1, 2, 3), EngineSamplingParams(max_tokens=4), 0.0))
    outputs = []
    for beat in range(1, 6, 2):
        members.sync(view(clock, {"w": reg("w", heartbeat=beat)}))  # its beat after the failure, then a newer one
        members.sync(view(clock, {"w": reg("w", heartbeat=beat + 1)}))
        assert scheduler.schedule(["w"]).plans["w"].new_requests[0].request_id == "poison"
        outputs = members.step_failed("w", "UNAVAILABLE")
        clock.now += 60
    [final] = outputs
    assert final.request_id == "poison" and final.finish_reason.value == "abort"
    assert final.error.kind is ErrorKind.UNAVAILABLE and "3 times" in final.error.message
    assert not scheduler.has_unfinished_requests()


def test_a_worker_owned_under_a_new_lease_epoch_is_reset_and_its_plans_carry_the_epoch():
    scheduler, connections, clock, members = make()
    members.sync(view(clock, {"w": reg("w")}, {"w": 7}))
    assert connections.epochs == {"w": 7}
    scheduler.add_request(EngineRequest("r", (1, 2, 3), EngineSamplingParams(max_tokens=4), 0.0))
    first = scheduler.schedule(["w"]).plans["w"]
    members.sync(view(clock, {"w": reg("w")}, {"w": 9}))  # another scheduler owned it meanwhile: dropped, admitted anew
    assert scheduler.worker_ids == ["w"] and scheduler.waiting_requests() == ["r"]
    assert connections.epochs == {"w": 9}
    again = scheduler.schedule(["w"]).plans["w"]
    assert again.session_id != first.session_id and again.new_requests[0].num_computed_tokens == 0


def test_a_worker_without_cpu_blocks_under_swap_preemption_is_admitted_with_a_warning(caplog):
    """Attack (2026-12-07): `pagedserve up --preemption-mode swap` without --swap-space preempted by recompute
    and said nothing."""
    from pagedserve.engine.config import PreemptionMode

    scheduler, clock = Scheduler(SchedulerConfig(preemption_mode=PreemptionMode.SWAP)), Clock()
    members = WorkerMembership(scheduler, Connections(), gone_after_s=5.0, clock=clock)
    members.sync(view(clock, {"w": reg("w")}))
    assert scheduler.worker_ids == ["w"] and "worker w has no CPU blocks" in caplog.text
