"""Executes plans on worker services over gRPC, all workers in parallel."""

from __future__ import annotations

import logging
from collections.abc import Mapping

import grpc

from services.common.auth import cluster_channel
from services.common.convert import plan_to_pb, step_result_from_pb
from pagedserve.engine.messages import BatchPlan, StepResult
from services.common.pb import engine_pb2_grpc
from pagedserve.engine.engine import ExecutionResult

log = logging.getLogger("pagedserve.scheduler")


class GrpcExecutor:
    """Sends each worker its plan with ``Worker.Execute`` and waits for every answer.

    A worker that fails or times out is reported in ``failed_worker_ids`` and forgotten.

    Args:
        step_timeout_s: longest one iteration may take on a worker, seconds.
        cluster_token: sent with every call (workers refuse calls without it).
    """

    def __init__(self, step_timeout_s: float, cluster_token: str) -> None:
        self._timeout = step_timeout_s
        self._token = cluster_token
        self._channels: dict[str, grpc.Channel] = {}
        self._stubs: dict[str, engine_pb2_grpc.WorkerStub] = {}

    def add_worker(self, worker_id: str, address: str) -> None:
        channel = cluster_channel(address, self._token)
        self._channels[worker_id] = channel
        self._stubs[worker_id] = engine_pb2_grpc.WorkerStub(channel)

    def remove_worker(self, worker_id: str) -> None:
        self._stubs.pop(worker_id, None)
        channel = self._channels.pop(worker_id, None)
        if channel is not None:
            channel.close()

    def execute(self, plans: Mapping[str, BatchPlan]) -> ExecutionResult:
        calls = {wid: self._stubs[wid].Execute.future(plan_to_pb(plan), timeout=self._timeout) for wid, plan in plans.items()}
        results: dict[str, StepResult] = {}
        failed: list[str] = []
        for wid, call in calls.items():
            try:
                results[wid] = step_result_from_pb(call.result())
            except grpc.RpcError as exc:
                log.error("worker %s failed step %d: %s", wid, plans[wid].step_id, exc)
                failed.append(wid)
        for wid in failed:
            self.remove_worker(wid)
        return ExecutionResult(results, tuple(failed))
