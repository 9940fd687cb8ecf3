"""Which unowned workers a scheduler takes: a share every scheduler computes alike from the same
owner keys and registrations, so that they divide the workers without talking to each other."""

from __future__ import annotations

from collections.abc import Mapping

from pagedserve.services.common.pb import engine_pb2 as pb


def workers_to_take(me: str, owners: Mapping[str, str | None], workers: Mapping[str, pb.WorkerRegistration],
                    schedulers: Mapping[str, pb.SchedulerRegistration], unowned_since: Mapping[str, float],
                    stale_before: float) -> list[str]:
    """The unowned workers scheduler ``me`` should take: greedily, in ``unowned_since``'s order (id
    order), each to the live scheduler owning the fewest KV blocks (ties by id); and any unowned since
    before ``stale_before`` (monotonic seconds: twice the lease TTL ago), whoever it would go to.

    Args:
        me: this scheduler's id.
        owners: each live worker's owner (``None``: unowned).
        workers: the live workers' registrations (their ``num_blocks``).
        schedulers: the live schedulers' registrations, by id.
        unowned_since: each unowned worker -> since when (monotonic seconds).
        stale_before: see above.
    """
    loads = dict.fromkeys([*schedulers, me], 0)
    for worker_id, owner in owners.items():
        if owner in loads:
            loads[owner] += workers[worker_id].num_blocks
    mine = []
    for worker_id in unowned_since:
        target = min(loads, key=lambda sid: (loads[sid], sid))
        loads[target] += workers[worker_id].num_blocks
        if target == me or unowned_since[worker_id] < stale_before:
            mine.append(worker_id)
    return mine
