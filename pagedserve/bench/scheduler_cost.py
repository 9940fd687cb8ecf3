"""The scheduler's own time per iteration, with the model step replaced by an instant answer."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from pagedserve.services.common.convert import plan_from_pb, plan_to_pb, step_result_from_pb, step_result_to_pb
from pagedserve.engine.messages import BatchPlan, EngineRequest, SampledToken, StepResult
from pagedserve.engine.sampling_params import EngineSamplingParams
from pagedserve.engine.config import SchedulerConfig
from pagedserve.engine.scheduler import Scheduler


@dataclass(frozen=True)
class IterationCost:
    """Milliseconds per iteration at one running count.

    Attributes:
        median_ms, p99_ms: schedule + update_from_output.
        median_with_proto_ms, p99_with_proto_ms: the same plus encoding the plan and decoding the
            result as the scheduler service does (the worker's side is not counted).
    """

    num_running: int
    median_ms: float
    p99_ms: float
    median_with_proto_ms: float
    p99_with_proto_ms: float


def _instant_result(plan: BatchPlan) -> StepResult:
    """Samples token 7 for every scheduled request (every request decodes once prompts are in)."""
    scheduled = [r.seq_id for r in plan.new_requests] + [r.seq_id for r in plan.cached_requests]
    return StepResult(plan.step_id, tuple(SampledToken(s, 7, 0.0, s.sample_index) for s in scheduled))


def scheduler_iteration_ms(num_running: int, iterations: int, prompt_len: int = 32) -> IterationCost:
    """Times ``iterations`` decode iterations with ``num_running`` sequences on one worker."""
    config = SchedulerConfig(block_size=16, max_num_seqs=num_running,
                             max_num_batched_tokens=max(2048, num_running * prompt_len))
    scheduler = Scheduler(config)
    blocks_each = (prompt_len + iterations + 20) // 16 + 2
    scheduler.add_worker("w0", num_running * blocks_each)
    params = EngineSamplingParams(max_tokens=iterations + 10, ignore_eos=True)
    for i in range(num_running):
        scheduler.add_request(EngineRequest(f"r{i}", tuple(range(100, 100 + prompt_len)), params, float(i)))
    first = scheduler.schedule(["w0"])  # every prompt in one iteration
    scheduler.update_from_output({"w0": _instant_result(first.plans["w0"])})
    plain, with_proto = [], []
    for _ in range(iterations):
        t0 = time.perf_counter()
        plan = scheduler.schedule(["w0"]).plans["w0"]
        t1 = time.perf_counter()
        wire = plan_to_pb(plan).SerializeToString()
        t2 = time.perf_counter()
        result_wire = step_result_to_pb(_instant_result(plan_from_pb_bytes(wire))).SerializeToString()
        t3 = time.perf_counter()
        result = step_result_from_pb_bytes(result_wire)
        t4 = time.perf_counter()
        scheduler.update_from_output({"w0": result})
        t5 = time.perf_counter()
        plain.append((t1 - t0 + t5 - t4) * 1000)
        with_proto.append((t2 - t0 + t5 - t3) * 1000)
    assert scheduler.stats().num_running == num_running
    return IterationCost(num_running, float(np.median(plain)), float(np.percentile(plain, 99)),
                         float(np.median(with_proto)), float(np.percentile(with_proto, 99)))


def plan_from_pb_bytes(wire: bytes) -> BatchPlan:
    from pagedserve.services.common.pb import engine_pb2 as pb

    msg = pb.BatchPlan()
    msg.ParseFromString(wire)
    return plan_from_pb(msg)


def step_result_from_pb_bytes(wire: bytes) -> StepResult:
    from pagedserve.services.common.pb import engine_pb2 as pb

    msg = pb.StepResult()
    msg.ParseFromString(wire)
    return step_result_from_pb(msg)
