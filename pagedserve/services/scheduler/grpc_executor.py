"""Sends plans to worker services over gRPC: the scheduler service's ``Executor`` (see
``pagedserve/engine/engine.py``). A plan's answer is a future, settled on a gRPC thread."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future

import grpc
from google.protobuf.message import DecodeError

from pagedserve.engine.engine import StepFailed, gather
from pagedserve.engine.structured_output import GrammarError
from pagedserve.engine.messages import BatchPlan, StepResult
from pagedserve.engine.structured_output import GRAMMAR_BUILD_TIMEOUT_S, StructuredOutput
from pagedserve.services.common.auth import cluster_channel
from pagedserve.services.common.convert import plan_to_pb, step_result_from_pb
from pagedserve.services.common.pb import engine_pb2_grpc, generate_pb2
from pagedserve.services.common.pb_fields import union_to_pb


class GrpcExecutor:
    """Sends each plan with ``Worker.Execute`` without waiting; its future gets the worker's
    ``StepResult`` or ``StepFailed`` (gRPC status and details). One channel per worker; two calls may
    still reach the worker's handlers in either order, and the worker runs them by ``step_id``
    (``PlanOrder``).

    Args:
        step_timeout_s: longest one step may take on a worker before it counts as failed, seconds.
        cluster_token: sent with every call (workers refuse calls without it).
        observe_plan_bytes: told each encoded plan's worker id and size, bytes (a metric).
    """

    def __init__(self, step_timeout_s: float, cluster_token: str,
                 observe_plan_bytes: Callable[[str, int], None]) -> None:
        self._timeout = step_timeout_s
        self._token = cluster_token
        self._observe_plan_bytes = observe_plan_bytes
        self._channels: dict[str, grpc.Channel] = {}
        self._stubs: dict[str, engine_pb2_grpc.WorkerStub] = {}
        self._epochs: dict[str, int] = {}
        self._grammar_calls: dict[str, Future[None]] = {}  # each worker's latest PrepareGrammar answer

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
        self._grammar_calls.pop(worker_id, None)
        channel = self._channels.pop(worker_id, None)
        if channel is not None:
            channel.close()

    def submit(self, worker_id: str, plan: BatchPlan) -> Future[StepResult]:
        """Sends ``plan`` to its worker; returns its answer's future.

        Raises:
            KeyError: the worker is not connected.
        """
        message = plan_to_pb(plan)
        message.lease_epoch = self._epochs[worker_id]
        self._observe_plan_bytes(worker_id, message.ByteSize())
        answer: Future[StepResult] = Future()
        call = self._stubs[worker_id].Execute.future(message, timeout=self._timeout)
        call.add_done_callback(lambda c: _settle(answer, c))
        return answer


    def prepare(self, structure: StructuredOutput) -> Future[None]:
        """Asks every connected worker to build ``structure``'s grammar (``Worker.PrepareGrammar``);
        the future raises ``GrammarError`` if one says it does not build or takes longer than
        ``GRAMMAR_BUILD_TIMEOUT_S``, and ``StepFailed`` if one cannot be reached."""
        message = union_to_pb(structure, generate_pb2.StructuredOutput)
        return gather([self._prepare_on(worker_id, message) for worker_id in self._stubs])

    def _prepare_on(self, worker_id: str, message: generate_pb2.StructuredOutput) -> Future[None]:
        """One ``PrepareGrammar`` call, sent once the worker answered the one before: a worker builds
        one grammar at a time, and calls waiting there would hold the threads its plans need."""
        answer: Future[None] = Future()

        def call(_previous: Future | None = None) -> None:
            stub = self._stubs.get(worker_id)
            if stub is None:
                answer.set_exception(StepFailed(f"worker {worker_id} is not connected"))
                return
            sent = stub.PrepareGrammar.future(message, timeout=GRAMMAR_BUILD_TIMEOUT_S)
            sent.add_done_callback(lambda c: _settle_grammar(answer, c))

        before = self._grammar_calls.get(worker_id)
        self._grammar_calls[worker_id] = answer
        if before is None:
            call()
        else:
            before.add_done_callback(call)  # at once if it is done
        return answer


def _settle_grammar(answer: Future[None], call: grpc.Future) -> None:
    """Settles ``answer`` with a ``PrepareGrammar`` call's outcome."""
    try:
        call.result()
        answer.set_result(None)
    except grpc.RpcError as exc:
        if exc.code() is grpc.StatusCode.INVALID_ARGUMENT:
            answer.set_exception(GrammarError(exc.details()))
        elif exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
            answer.set_exception(GrammarError(f"the grammar did not build within {GRAMMAR_BUILD_TIMEOUT_S:g} s"))
        else:
            answer.set_exception(StepFailed(f"{exc.code().name}: {exc.details()}"))
    except grpc.FutureCancelledError:
        answer.set_exception(StepFailed("CANCELLED"))


def _settle(answer: Future[StepResult], call: grpc.Future) -> None:
    """Gives ``answer`` the call's step result, or ``StepFailed`` saying why there is none."""
    try:
        answer.set_result(step_result_from_pb(call.result()))
    except grpc.RpcError as exc:
        answer.set_exception(StepFailed(f"{exc.code().name}: {exc.details()}"))
    except grpc.FutureCancelledError:
        answer.set_exception(StepFailed("CANCELLED"))
    except (DecodeError, ValueError) as exc:  # an answer no worker of ours sends
        answer.set_exception(StepFailed(f"malformed step result: {exc}"))
