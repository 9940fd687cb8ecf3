"""The gateway's graceful shutdown: stop taking requests, let those in flight finish within a grace.

On SIGTERM (what Kubernetes and docker-compose send first) the gateway drains: its health turns
NOT_SERVING so that load balancers stop sending it work, every new request is refused with
UNAVAILABLE (HTTP 503 with ``Retry-After``) so that clients retry on another gateway, and the
requests in flight stream on. When they are all done, or when the grace has passed, the gateway
stops; the requests still unfinished then end with UNAVAILABLE (their KV blocks are freed in the
scheduler, as for a client that went away).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from pagedserve.services.gateway.generation_core import GenerationCore, SampleDelta, Submission
from pagedserve.services.gateway.generation_errors import GenerationError, StatusKind

log = logging.getLogger("pagedserve.gateway")

POLL_S = 0.05
"""How often the drain looks whether the requests in flight are done, seconds."""


class DrainingCore(GenerationCore):
    """A ``GenerationCore`` that can be drained (``drain``): afterwards ``check_capacity`` refuses
    every new request with UNAVAILABLE, and once the grace has passed the requests still being
    generated end with UNAVAILABLE. Takes the arguments of ``GenerationCore``."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._draining = False
        self._expired = asyncio.Event()

    @property
    def draining(self) -> bool:
        """Whether the gateway is shutting down (new requests are refused)."""
        return self._draining

    def check_capacity(self, num_requests: int = 1) -> None:
        """As ``GenerationCore.check_capacity``; while draining, raises ``GenerationError(UNAVAILABLE)``."""
        if self._draining:
            raise GenerationError(StatusKind.UNAVAILABLE,
                                  "the gateway is shutting down and takes no new requests; retry on another gateway")
        super().check_capacity(num_requests)

    async def generate(self, submission: Submission) -> AsyncIterator[SampleDelta]:
        """As ``GenerationCore.generate``, but ends with ``GenerationError(UNAVAILABLE)`` when the
        drain's grace passes first (the request is aborted in the scheduler)."""
        stream = super().generate(submission)
        expired = asyncio.ensure_future(self._expired.wait())
        step: asyncio.Future | None = None
        try:
            while True:
                step = asyncio.ensure_future(anext(stream))
                await asyncio.wait({step, expired}, return_when=asyncio.FIRST_COMPLETED)
                if not step.done():
                    raise GenerationError(StatusKind.UNAVAILABLE, "the gateway shut down before the request "
                                          "finished (its shutdown grace passed); retry")
                try:
                    sample = step.result()
                except StopAsyncIteration:
                    return
                yield sample
        finally:
            expired.cancel()
            if step is not None and not step.done():  # the request is cancelled there (and aborted)
                step.cancel()
                await asyncio.gather(step, return_exceptions=True)
            await stream.aclose()

    async def drain(self, grace_s: float) -> int:
        """Refuses new requests from now on and waits until the requests in flight are done, or
        ``grace_s`` seconds; then ends those left. Returns how many were left."""
        self._draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        log.info("draining: %d request(s) in flight get up to %g s to finish; new ones are refused",
                 self.num_in_flight, grace_s)
        while self.num_in_flight and loop.time() < deadline:
            await asyncio.sleep(POLL_S)
        left = self.num_in_flight
        if left:
            log.warning("the shutdown grace of %g s passed: ending the %d request(s) still in flight", grace_s, left)
        self._expired.set()
        return left
