"""The gateway's generation core, free of any transport: queue a parsed request, stream its text.

Both front ends (the gRPC Generation service and the OpenAI-compatible HTTP API) are thin shells
over ``GenerationCore``: they parse their own request format into a ``ParsedRequest``, iterate
``GenerationCore.generate`` and translate a ``GenerationError``'s ``StatusKind`` into a gRPC
status or an HTTP status.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import NoReturn

import redis

from pagedserve.engine.messages import EngineRequest
from pagedserve.engine.outputs import OutputKind, RequestOutput
from pagedserve.text.output_processor import TextDelta
from pagedserve.text.request_samples import ParsedRequest, RequestSamples
from pagedserve.text.tokenizer import PromptTokenizer
from pagedserve.services.common.redis_pool import SOCKET_TIMEOUT_S
from pagedserve.services.gateway.generation_errors import STATUS_OF_ERROR, GenerationError, StatusKind
from pagedserve.services.gateway.metrics import GatewayMetrics, RequestMetrics
from pagedserve.services.gateway.queue_producer import RequestQueueProducer
from pagedserve.services.gateway.router import OutputRouter, ResumeQuery

log = logging.getLogger("pagedserve.gateway")

LOST_CHECK_S = 5
"""How often a request no scheduler has taken yet checks that its stream entry still exists, seconds."""

ENQUEUE_TIMEOUT_S = SOCKET_TIMEOUT_S
"""Longest wait for Redis to take a new request, seconds (one Redis reply's timeout): a hung Redis
(SIGSTOP, swapping) otherwise held a request through every retry of every timeout, 1 min 55 s in an attack,
while the gateway's health already said NOT_SERVING. The request then fails with ``UNAVAILABLE``; its entry,
should Redis queue it later, is deleted."""

TAKEOVER_S = 7.0
"""Time a surviving scheduler may take, after a dead peer's lease expired, to notice it and claim its
requests (its ticks and the claim), seconds: the gateway waits a request's scheduler's lease TTL plus this."""

MAX_REQUEUES = 3
"""How often a request whose stream entry vanished before any scheduler took it (Redis restarted
empty) is queued again before it fails with ``UNAVAILABLE``."""


@dataclass
class _QueuedEntry:
    """A request's stream entry, and how often it was queued again."""

    entry_id: bytes
    requeues: int = 0


@dataclass(frozen=True)
class Usage:
    """Token counts of a finished request (all samples together for the completion tokens)."""

    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class SampleDelta:
    """What one engine output adds to one sample of a request.

    Attributes:
        sample_index: which of the request's ``n`` samples, in ``[0, n)``.
        delta: the sample's new text and token ids; ``delta.finish_reason`` is set on the
            sample's last delta only.
        usage: set on the request's very last delta (every sample finished), else None.
    """

    sample_index: int
    delta: TextDelta
    usage: Usage | None = None


@dataclass(frozen=True)
class Submission:
    """One request to generate for.

    Attributes:
        parsed: the validated, tokenized request.
        trace_context: W3C trace headers of the caller's span (carried to the scheduler and workers).
        key: the request's identity across gateway, Redis and scheduler; new for every submission
            (a client's own request id is only a label).
        arrived_s: when the front end received the request, ``time.monotonic()`` seconds (the start
            of its TTFT and e2e latency).
    """

    parsed: ParsedRequest
    trace_context: Mapping[str, str] = field(default_factory=dict)
    key: str = field(default_factory=lambda: uuid.uuid4().hex)
    arrived_s: float = field(default_factory=time.monotonic)


class GenerationCore:
    """Queues requests in Redis and streams their per-sample text deltas back.

    Args:
        tokenizer: decodes the output tokens.
        producer: puts requests on the Redis request stream.
        router: receives this gateway's token events from the schedulers.
        max_concurrent_requests: requests in flight above which ``check_capacity`` refuses.
        metrics: the gateway's Prometheus series; every request's deltas are recorded there.
        scheduler_grace_s: how long a request waits for its scheduler's lost stream to come back,
            or (before a scheduler took it) for any scheduler stream, before failing with
            ``UNAVAILABLE``, seconds, at least: when a scheduler dies, a survivor takes its requests
            over once the dead one's lease expires and sends a resume query, which makes the survivor
            the owner, so the gateway waits no less than the longest lease TTL the schedulers
            registered plus ``TAKEOVER_S`` (:meth:`grace_s`), or requests would fail that would have moved.
    """

    def __init__(self, tokenizer: PromptTokenizer, producer: RequestQueueProducer, router: OutputRouter,
                 max_concurrent_requests: int, metrics: GatewayMetrics, scheduler_grace_s: float = 10.0) -> None:
        self.tokenizer = tokenizer
        self.metrics = metrics
        self._producer = producer
        self._router = router
        self._max_concurrent = max_concurrent_requests
        self._unreachable_logged: dict[str | None, float] = {}  # scheduler -> when a failure for it was logged
        self._min_grace_s = scheduler_grace_s

    @property
    def num_in_flight(self) -> int:
        """Requests being generated for now."""
        return self._router.num_in_flight

    def grace_s(self) -> float:
        """How long a request waits for a lost scheduler stream before failing, seconds: the configured grace,
        or the longest lease TTL a scheduler registered plus ``TAKEOVER_S`` when that is longer (none registered
        one: the configured grace)."""
        ttl_s = self._router.discovery.longest_lease_ttl_s
        return max(self._min_grace_s, ttl_s + TAKEOVER_S) if ttl_s > 0 else self._min_grace_s

    def check_capacity(self, num_requests: int = 1) -> None:
        """Raises ``GenerationError(RESOURCE_EXHAUSTED)`` when ``num_requests`` more would exceed
        the gateway's limit of requests in flight, ``INVALID_ARGUMENT`` naming ``prompt`` when they
        alone would (a retry cannot help)."""
        if num_requests > self._max_concurrent:
            raise GenerationError(StatusKind.INVALID_ARGUMENT, f"prompt: {num_requests} prompts, where this gateway "
                                  f"takes at most {self._max_concurrent} requests at once; send fewer", "prompt")
        in_flight = self._router.num_in_flight
        if in_flight + num_requests > self._max_concurrent:
            raise GenerationError(StatusKind.RESOURCE_EXHAUSTED,
                                  f"the gateway has {in_flight} requests in flight; {num_requests} more would pass its "
                                  f"limit of {self._max_concurrent}; retry later")

    def check_scheduler(self) -> None:
        """Raises ``GenerationError(UNAVAILABLE)`` when no scheduler stream has been open for
        longer than the grace period."""
        if self._router.discovery.none_connected_for_s() > self.grace_s():
            raise GenerationError(StatusKind.UNAVAILABLE, "no scheduler is reachable; retry later")

    async def generate(self, submission: Submission) -> AsyncIterator[SampleDelta]:
        """Queues the request and yields its samples' non-empty deltas until every sample finished.

        Closing or cancelling the iteration early (the client went away) aborts the request in
        the scheduler, which frees its KV blocks, and deletes its queue entry if still unread. When
        a scheduler takes the request over (a resume query), it is told what the client received.

        Raises:
            GenerationError: ``RESOURCE_EXHAUSTED`` (the gateway full: ``check_capacity``), ``UNAVAILABLE``
                (Redis or the scheduler unreachable, the request lost),
                ``ABORTED`` (the token stream broke), or the kind the engine failed the request with.
        """
        key, parsed = submission.key, submission.parsed
        self.check_capacity()  # again, with no await before the registration: the front ends check before
        outputs = self._router.register(key)  # parsing, and a burst could all pass that check at once
        state = RequestSamples(self.tokenizer, parsed.prompt_token_ids, parsed.params)
        request_metrics = RequestMetrics(self.metrics, submission.arrived_s)
        entry: _QueuedEntry | None = None
        try:
            entry = _QueuedEntry(await self._enqueue(submission))
            accepted = False  # until the scheduler's first event: the request may still be lost with Redis
            while not state.finished:
                output = await self._next_output(submission, outputs, None if accepted else entry)
                accepted = True
                if isinstance(output, ResumeQuery):  # every output queued before it is processed
                    self._router.resume(key, output, state.received())
                    continue
                if output.kind is OutputKind.TAKEN:  # no tokens yet: the queue entry is no longer watched
                    continue
                delta = self._process(state, output)
                request_metrics.delta(output.sample_index, delta, state.num_prompt_tokens)
                if delta.stop_string_matched:
                    self._router.background.start(self._router.abort_sample(key, output.sample_index))
                if delta.text or delta.token_ids or delta.finish_reason:
                    usage = Usage(state.num_prompt_tokens, state.num_output_tokens) if state.finished else None
                    yield SampleDelta(output.sample_index, delta, usage)
        finally:
            # Not finished: the client went away or the call failed, nothing may run for it, and a
            # scheduler restarted later must not run it for nobody (its stream entry goes).
            if state.finished:
                self._router.unregister(key)
            else:
                self._router.abandon(key)
                if entry is not None:
                    self._router.background.start(self._producer.forget(entry.entry_id))
                request_metrics.aborted(parsed.params.num_samples)

    async def _enqueue(self, submission: Submission) -> bytes:
        """Queues the request and returns its stream entry's id. Cancelled while Redis has it (the
        client went away before the reply was read), the entry is deleted once queued.

        Raises:
            GenerationError: ``UNAVAILABLE`` when Redis fails or does not take the request within
                ``ENQUEUE_TIMEOUT_S`` (the entry, should Redis queue it later, is deleted then too).
        """
        parsed = submission.parsed
        request = EngineRequest(submission.key, parsed.prompt_token_ids, parsed.engine_params, time.time(),
                                dict(submission.trace_context), parsed.priority, parsed.cache_salt)
        queued = asyncio.ensure_future(self._producer.enqueue(request))
        try:
            async with asyncio.timeout(ENQUEUE_TIMEOUT_S):  # not wait_for, which can lose a cancel (see redis_pool)
                return await asyncio.shield(queued)
        except asyncio.CancelledError:
            self._router.background.start(self._forget_when_queued(queued))
            raise
        except TimeoutError as exc:
            self._router.background.start(self._forget_when_queued(queued))
            raise GenerationError(StatusKind.UNAVAILABLE, f"Redis did not take the request within "
                                  f"{ENQUEUE_TIMEOUT_S:g} s (is it overloaded or stopped?); retry later") from exc
        except redis.RedisError as exc:
            raise GenerationError(StatusKind.UNAVAILABLE,
                                  f"cannot queue the request (Redis: {exc}); retry later") from exc

    async def _forget_when_queued(self, queued: asyncio.Future[bytes]) -> None:
        with contextlib.suppress(redis.RedisError):  # never queued: nothing to delete
            await self._producer.forget(await queued)

    @staticmethod
    def _process(state: RequestSamples, output: RequestOutput) -> TextDelta:
        if output.error is not None:
            raise GenerationError(STATUS_OF_ERROR[output.error.kind], output.error.message)
        try:
            return state.process(output)
        except ValueError as exc:  # tokens missing from the stream: the request cannot go on exactly
            raise GenerationError(StatusKind.ABORTED, f"the token stream broke ({exc}); retry") from exc

    async def _next_output(self, submission: Submission, outputs: asyncio.Queue[RequestOutput | ResumeQuery],
                           unread: _QueuedEntry | None) -> RequestOutput | ResumeQuery:
        """The next event or resume query. Fails with UNAVAILABLE when the request stays without a
        reachable scheduler too long (``OutputRouter.unreachable_for_s``). While no scheduler has
        taken the request (``unread``: its stream entry), the entry is checked every
        ``LOST_CHECK_S``: one that vanished from Redis (it restarted empty) is queued again, at
        most ``MAX_REQUEUES`` times (no scheduler ran it: the new entry starts it exactly)."""
        waited_s = 0
        while True:
            try:
                async with asyncio.timeout(1.0):  # not wait_for, which can lose a cancel (see redis_pool)
                    return await outputs.get()
            except TimeoutError:
                waited_s += 1
                if (unreachable_s := self._router.unreachable_for_s(submission.key)) > self.grace_s():
                    self._fail_unreachable(submission.key, unreachable_s)
                if unread is not None and waited_s % LOST_CHECK_S == 0 and await self._producer.lost(unread.entry_id):
                    await self._requeue(submission, unread)

    def _fail_unreachable(self, key: str, unreachable_s: float) -> NoReturn:
        """Raises UNAVAILABLE for a request without a scheduler stream for ``unreachable_s`` seconds (``inf``:
        its scheduler is unknown or forgotten), logging why once per scheduler per grace period (the
        other requests of a scheduler that died fail in the same second)."""
        owner, grace_s = self._router.owner_of(key), self.grace_s()
        now = time.monotonic()
        if now - self._unreachable_logged.get(owner, -math.inf) > grace_s:
            self._unreachable_logged[owner] = now
            log.warning("request %s (and any other of %s failing in the next %g s): no stream for %.1f s, over the "
                        "grace of %g s; it ends UNAVAILABLE. Links: %s", key,
                        f"scheduler {owner}" if owner is not None else "no scheduler yet", grace_s,
                        unreachable_s, grace_s, self._router.discovery.describe())
        waited = f"for {unreachable_s:.1f} s" if math.isfinite(unreachable_s) else "(it left the cluster)"
        message = f"lost the connection to the request's scheduler {waited}, longer than the gateway waits"
        raise GenerationError(StatusKind.UNAVAILABLE, f"{message} ({grace_s:g} s); retry") from None

    async def _requeue(self, submission: Submission, entry: _QueuedEntry) -> None:
        """Queues a request whose entry Redis lost again (updating ``entry``).

        Raises:
            GenerationError: ``UNAVAILABLE`` after ``MAX_REQUEUES`` times, or when Redis refuses.
        """
        if entry.requeues == MAX_REQUEUES:
            raise GenerationError(StatusKind.UNAVAILABLE, f"the request was lost {MAX_REQUEUES + 1} times before a "
                                                          "scheduler took it (Redis keeps restarting?); retry")
        log.warning("request %s was lost from Redis before a scheduler took it (Redis restarted empty?); "
                    "queuing it again", submission.key)
        entry.entry_id = await self._enqueue(submission)
        entry.requeues += 1
