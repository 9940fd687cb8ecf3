"""The gateway's check that each scheduler still holds the requests it owns there: a request whose
last output was lost (a scheduler restarted under the same id, a batch lost in a stream takeover)
would otherwise wait for ever, its owner's stream being up."""

from __future__ import annotations

import asyncio
import logging

import grpc

from pagedserve.services.common.limits import MAX_HELD_QUERY_IDS
from pagedserve.services.common.pb import engine_pb2 as pb
from pagedserve.services.gateway.router import CALL_TIMEOUT_S, OutputRouter

log = logging.getLogger("pagedserve.gateway")

HELD_CHECK_S = 20.0
"""How often the gateway asks each connected scheduler which of the requests it owns there, quiet
for as long, it still holds, seconds. A request not held at two checks in a row ends UNAVAILABLE:
at most about three checks (60 s) after the last output it got."""


class HeldCheck:
    """Asks every ``interval_s`` (``HELD_CHECK_S``); ``run`` until cancelled.

    Args:
        router: the requests, their owners and the scheduler links.
        interval_s: seconds between checks, and how long a request must be quiet to be asked about.
    """

    def __init__(self, router: OutputRouter, interval_s: float = HELD_CHECK_S) -> None:
        self._router = router
        self._interval_s = interval_s
        self._suspects: dict[str, tuple[str, float]] = {}  # key -> (the scheduler that did not hold it at the
        # last check, when the request had last heard from it then)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                await self.check_once()
            except Exception:  # a link closed under the call, ...: the next check asks again
                log.exception("checking which requests the schedulers hold failed")

    async def check_once(self) -> None:
        """Asks each connected scheduler about its quiet requests; ends those not held at the last
        check either (by the same scheduler, and quiet since)."""
        not_held: dict[str, tuple[str, float]] = {}
        for link in self._router.discovery.connected_links():
            quiet = self._router.quiet_owned(link.scheduler_id, self._interval_s)
            keys = list(quiet)
            for start in range(0, len(keys), MAX_HELD_QUERY_IDS):
                batch = keys[start:start + MAX_HELD_QUERY_IDS]
                try:
                    reply = await link.stub.HeldRequests(pb.HeldRequestsRequest(request_ids=batch),
                                                         timeout=CALL_TIMEOUT_S)
                except grpc.RpcError as exc:  # asked again at the next check
                    log.info("cannot ask scheduler %s which requests it holds: %s", link.scheduler_id, exc.code())
                    break
                held = set(reply.request_ids)
                not_held.update((key, (link.scheduler_id, quiet[key])) for key in batch if key not in held)
        for key, suspect in not_held.items():
            if self._suspects.get(key) == suspect:  # the same scheduler, and nothing heard since
                log.warning("request %s: scheduler %s no longer holds it and sent nothing for %g s or more; it "
                            "ends UNAVAILABLE", key, suspect[0], 2 * self._interval_s)
                self._router.end_unheld(key, *suspect)
        self._suspects = {key: s for key, s in not_held.items() if self._suspects.get(key) != s}
