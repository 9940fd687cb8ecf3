"""Real in-process Scheduler gRPC servers that stream what a test gives them and record the Abort
and Resume calls they get, scheduler registrations written into a real Redis, and a gateway's core
and router over two of them (``Gateway``)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable

import grpc
import redis

from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.text.request_samples import ParsedRequest
from pagedserve.services.common import redis_keys
from pagedserve.services.common.auth import CLUSTER_TOKEN_KEY, AioMetadataAuthInterceptor
from pagedserve.services.common.pb import engine_pb2 as pb
from pagedserve.services.common.pb import engine_pb2_grpc
from pagedserve.services.common.redis_pool import async_redis_client
from pagedserve.services.common.signed_records import sign_record
from pagedserve.services.gateway.generation_core import GenerationCore, Submission
from pagedserve.services.gateway.generation_errors import GenerationError
from pagedserve.services.gateway.metrics import GatewayMetrics
from pagedserve.services.gateway.queue_producer import RequestQueueProducer
from pagedserve.services.gateway.router import OutputRouter

TOKEN = "test-cluster-token"
STOP_WAIT_S = 2.0
"""Longest wait for a stopped server's handlers to end, seconds (see ``FakeScheduler.stop``)."""
SCENARIO_TIMEOUT_S = 40.0
"""Longest a scenario of :func:`run_scenario` may run, seconds (below the tests' 60 s pytest timeout)."""
CLEANUP_WAIT_S = 5.0
"""Longest wait for the tasks a scenario left behind to end once cancelled, seconds."""


class FakeScheduler(engine_pb2_grpc.SchedulerServicer):
    """A Scheduler service double behind a real asyncio gRPC server (cluster token required).

    Every StreamOutputs call streams the batches put in ``outbox``; Abort and Resume calls are
    recorded (and answered ``found=True``), but the next ``aborts_to_fail`` Aborts fail with UNAVAILABLE.
    HeldRequests answers that it holds every request asked about but those in ``forgotten``.
    """

    def __init__(self, scheduler_id: str) -> None:
        self.scheduler_id = scheduler_id
        self.outbox: asyncio.Queue[pb.TokenEventBatch] = asyncio.Queue()
        self.aborts: list[pb.AbortRequest] = []
        self.resumes: list[pb.ResumeRequest] = []
        self.stream_gateways: list[str] = []  # gateway id of every StreamOutputs call
        self.open_streams = 0
        self.server: grpc.aio.Server | None = None
        self.stopped = False
        self.refusing = False
        self.aborts_to_fail = 0
        self.forgotten: set[str] = set()
        self.held_queries: list[list[str]] = []
        self.address = ""

    async def start(self) -> FakeScheduler:
        self.server = grpc.aio.server(interceptors=[AioMetadataAuthInterceptor(CLUSTER_TOKEN_KEY, TOKEN, "token")])
        engine_pb2_grpc.add_SchedulerServicer_to_server(self, self.server)
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        await self.server.start()
        return self

    async def stop(self) -> None:
        """Stops the server (a no-op the second time). grpc.aio's ``stop`` waits for the handlers to
        end, which a stream handler racing a gateway's reconnect now and then never does (1 run in
        17 hung there, and the half-stopped server, finalized later by the garbage collector, joined
        grpc's poller thread for ever): the wait is bounded by ``STOP_WAIT_S`` without cancelling it
        (``asyncio.wait_for`` would wait for the cancellation), and asyncio.run, cancelling that
        leftover wait at the end, hung the same way (CI, stop 31): so the open streams are ended first
        (``refuse_streams``), and the server stopped once none is left."""
        if self.stopped:
            return
        self.stopped = True
        self.refuse_streams()
        deadline = time.monotonic() + STOP_WAIT_S
        while self.open_streams and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await asyncio.wait({asyncio.ensure_future(self.server.stop(grace=None))}, timeout=STOP_WAIT_S)

    def refuse_streams(self) -> None:
        """Ends the open StreamOutputs calls and refuses new ones with UNAVAILABLE: to its gateways,
        this scheduler is gone, while its server stays up (see ``stop``)."""
        self.refusing = True
        for _ in range(max(1, self.open_streams)):  # wakes each open stream, which then ends
            self.outbox.put_nowait(pb.TokenEventBatch())

    def send(self, *events: pb.TokenEvent, resume_queries: tuple[str | tuple[str, int], ...] = ()) -> None:
        """Streams one batch to the gateway (when its stream is open)."""
        queries = [pb.ResumeQuery(request_id=q, taken_at_us=time.time_ns() // 1000) if isinstance(q, str)
                   else pb.ResumeQuery(request_id=q[0], taken_at_us=q[1]) for q in resume_queries]
        self.outbox.put_nowait(pb.TokenEventBatch(events=events, resume_queries=queries))

    def aborted(self, request_id: str) -> list[pb.AbortRequest]:
        return [a for a in self.aborts if a.request_id == request_id]

    async def StreamOutputs(self, request, context):
        if self.refusing:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "this scheduler is gone")
        self.stream_gateways.append(request.gateway_id)
        await context.send_initial_metadata(())  # as the real scheduler: the stream is up before any event
        self.open_streams += 1
        try:
            while True:
                batch = await self.outbox.get()
                if self.refusing:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "this scheduler is gone")
                yield batch
        finally:
            self.open_streams -= 1

    async def Abort(self, request, context):
        self.aborts.append(request)
        if self.aborts_to_fail:
            self.aborts_to_fail -= 1
            await context.abort(grpc.StatusCode.UNAVAILABLE, "a link blip")
        return pb.AbortResponse(found=True)

    async def Resume(self, request, context):
        self.resumes.append(request)
        return pb.ResumeResponse(found=True)

    async def HeldRequests(self, request, context):
        self.held_queries.append(list(request.request_ids))
        return pb.HeldRequestsResponse(request_ids=[r for r in request.request_ids if r not in self.forgotten])


def event(request_id: str, first: int, token_ids: list[int], sample_index: int = 0,
          finish: int = pb.FINISH_REASON_UNSPECIFIED) -> pb.TokenEvent:
    return pb.TokenEvent(request_id=request_id, first_output_index=first, token_ids=token_ids,
                         sample_index=sample_index, finish_reason=finish)


def register(client: redis.Redis, scheduler_id: str, address: str, lease_ms: int = 60_000,
             token: str | None = TOKEN, lease_ttl_s: float = 0.0) -> pb.SchedulerRegistration:
    """Writes a scheduler's registration (signed with ``token``; None: unsigned; ``lease_ttl_s`` the TTL it
    says its leases have, 0: none said) and its lease."""
    registration = pb.SchedulerRegistration(scheduler_id=scheduler_id, address=address,
                                            instance_id=uuid.uuid4().hex, num_blocks=64, lease_ttl_s=lease_ttl_s)
    if token is not None:
        sign_record(registration, token)
    client.hset(redis_keys.SCHEDULERS_HASH, scheduler_id, registration.SerializeToString())
    client.set(redis_keys.scheduler_lease_key(scheduler_id), registration.instance_id, px=lease_ms)
    return registration


async def until(condition: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    """Waits until ``condition()`` holds.

    Raises:
        AssertionError: it did not within ``timeout_s`` seconds.
    """
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def run_scenario(scenario: Callable[[], Awaitable[None]], timeout_s: float = SCENARIO_TIMEOUT_S) -> None:
    """Runs ``scenario()`` in a new event loop with a bounded run and a bounded clean-up.

    ``asyncio.run`` waits without limit for the tasks left at the end (a grpc.aio server stop
    among them, see ``FakeScheduler.stop``): a CI run once hung there until pytest's timeout, with
    only the idle event loop's stack to show. Here the leftovers get ``CLEANUP_WAIT_S`` seconds
    once cancelled, and a scenario still running after ``timeout_s`` fails with every task's stack.

    Raises:
        AssertionError: the scenario ran past ``timeout_s`` (the message holds each task's stack).
    """
    async def bounded() -> None:
        task = asyncio.ensure_future(scenario())
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
        if not done:
            stacks = "\n".join(_task_stack(t) for t in asyncio.all_tasks() if t is not asyncio.current_task())
            task.cancel()
            raise AssertionError(f"the scenario ran past {timeout_s} s; its tasks:\n{stacks}")
        task.result()

    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(bounded())
    finally:
        leftovers = asyncio.all_tasks(loop)
        for task in leftovers:
            task.cancel()
        if leftovers:
            loop.run_until_complete(asyncio.wait(leftovers, timeout=CLEANUP_WAIT_S))
        loop.run_until_complete(asyncio.wait({loop.create_task(loop.shutdown_asyncgens())}, timeout=CLEANUP_WAIT_S))
        loop.close()


def _task_stack(task: asyncio.Task) -> str:
    """The task's chain of awaits, outermost first (``Task.get_stack`` shows only the outermost
    frame of a suspended coroutine)."""
    lines, awaited = [], task.get_coro()
    while awaited is not None:
        frame = getattr(awaited, "cr_frame", None) or getattr(awaited, "gi_frame", None)
        if frame is not None:
            lines.append(f"  {frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}\n")
        else:
            lines.append(f"  {awaited!r}\n")
        awaited = getattr(awaited, "cr_await", None) or getattr(awaited, "gi_yieldfrom", None)
    return f"{task.get_name()}:\n{''.join(lines)}"


class Letters:
    """Token i decodes to the i-th letter."""

    def decode(self, ids, skip_special_tokens):
        return "".join(chr(ord("a") + i) for i in ids)


class Gateway:
    """A gateway's core and router over two fake schedulers registered in Redis; one request's
    deltas are collected as its client would receive them."""

    def __init__(self, client: redis.Redis, redis_url: str, grace_s: float = 10.0, lease_ttl_s: float = 0.0) -> None:
        self.client, self.redis_url, self.grace_s, self.lease_ttl_s = client, redis_url, grace_s, lease_ttl_s
        self.deltas: list = []

    async def __aenter__(self) -> Gateway:
        self.s1, self.s2 = await FakeScheduler("s1").start(), await FakeScheduler("s2").start()
        register(self.client, "s1", self.s1.address, lease_ttl_s=self.lease_ttl_s)
        register(self.client, "s2", self.s2.address, lease_ttl_s=self.lease_ttl_s)
        aclient = async_redis_client(self.redis_url, 8)
        self.metrics = GatewayMetrics("m")
        self.router = OutputRouter(aclient, TOKEN, "gw-1", self.metrics.requests_migrated.inc, poll_interval_s=0.1)
        self.core = GenerationCore(Letters(), RequestQueueProducer(aclient, "gw-1", TOKEN), self.router, 8, self.metrics,
                                   scheduler_grace_s=self.grace_s)
        self._tasks = [asyncio.create_task(self.router.run())]
        await until(lambda: len(self.router.discovery.connected_links()) == 2, "both scheduler streams")
        return self

    async def __aexit__(self, *exc) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(self.s1.stop(), self.s2.stop())

    async def submit(self, params: SamplingParams) -> str:
        """Starts a request and returns its key once it is queued in Redis."""
        submission = Submission(ParsedRequest((1,), params, params.to_engine(1, 100, 26, ())))
        self._tasks.append(asyncio.create_task(self._collect(submission)))
        await until(lambda: self.client.xlen(redis_keys.REQUEST_STREAM) == len(self._tasks) - 1, "the request queued")
        return submission.key

    async def _collect(self, submission: Submission) -> None:
        try:
            async for sample in self.core.generate(submission):
                self.deltas.append(sample)
        except GenerationError as exc:
            self.error = exc
        self.done = True

    def token_ids(self, sample_index: int = 0) -> list[int]:
        return [t for d in self.deltas if d.sample_index == sample_index for t in d.delta.token_ids]

    def text(self, sample_index: int = 0) -> str:
        return "".join(d.delta.text for d in self.deltas if d.sample_index == sample_index)
