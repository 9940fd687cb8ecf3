"""Sends plans to worker services over gRPC, one step in flight per worker, answers as they come."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import grpc

from services.common.auth import cluster_channel
from pagedserve.engine.messages import BatchPlan, StepResult
from services.common.convert import plan_to_pb, step_result_from_pb
from services.common.pb import engine_pb2_grpc


@dataclass(frozen=True)
class StepDone:
    """A worker's answer to one plan: its result, or why the step failed.

    Attributes:
        worker_id: the worker that ran the plan.
        session_id: the plan's session (an answer from an older session of the worker is stale).
        result: the step's result; ``None`` when the step failed.
        error: what went wrong (gRPC status and details) when it failed.
    """

    worker_id: str
    session_id: str
    result: StepResult | None
    error: str = ""


class GrpcExecutor:
    """Runs each worker's step pipeline: ``submit`` sends a plan with ``Worker.Execute`` without
    waiting; ``on_done`` is called (on a gRPC thread) with the answer.

    Args:
        step_timeout_s: longest one step may take on a worker before it counts as failed, seconds.
        cluster_token: sent with every call (workers refuse calls without it).
        on_done: receives every answer, failed or not.
    """

    def __init__(self, step_timeout_s: float, cluster_token: str, on_done: Callable[[StepDone], None]) -> None:
        self._timeout = step_timeout_s
        self._token = cluster_token
        self._on_done = on_done
        self._channels: dict[str, grpc.Channel] = {}
        self._stubs: dict[str, engine_pb2_grpc.WorkerStub] = {}
        self._epochs: dict[str, int] = {}

    def add_worker(self, worker_id: str, address: str, lease_epoch: int) -> None:
        """Opens a channel to a worker; every plan sent to it carries ``lease_epoch``.

        Raises:
            ValueError: the id is already connected.
        """
        if worker_id in self._channels:
            raise ValueError(f"worker {worker_id!r} is already connected")
        channel = cluster_channel(address, self._token)
        self._channels[worker_id] = channel
        self._stubs[worker_id] = engine_pb2_grpc.WorkerStub(channel)
        self._epochs[worker_id] = lease_epoch

    def remove_worker(self, worker_id: str) -> None:
        """Closes the worker's channel (a step in flight fails with CANCELLED)."""
        self._stubs.pop(worker_id, None)
        self._epochs.pop(worker_id, None)
        channel = self._channels.pop(worker_id, None)
        if channel is not None:
            channel.close()

    def submit(self, worker_id: str, plan: BatchPlan) -> int:
        """Sends ``plan`` to its worker; the answer goes to ``on_done``. Returns the encoded plan's
        size, bytes.

        Raises:
            KeyError: the worker is not connected.
        """
        message = plan_to_pb(plan)
        message.lease_epoch = self._epochs[worker_id]
        call = self._stubs[worker_id].Execute.future(message, timeout=self._timeout)
        call.add_done_callback(lambda c: self._on_done(self._answer(worker_id, plan, c)))
        return message.ByteSize()

    @staticmethod
    def _answer(worker_id: str, plan: BatchPlan, call: grpc.Future) -> StepDone:
        try:
            return StepDone(worker_id, plan.session_id, step_result_from_pb(call.result()))
        except grpc.RpcError as exc:
            return StepDone(worker_id, plan.session_id, None, f"{exc.code().name}: {exc.details()}")
        except grpc.FutureCancelledError:
            return StepDone(worker_id, plan.session_id, None, "CANCELLED")
