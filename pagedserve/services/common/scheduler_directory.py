"""The live schedulers, as registered in Redis: read by gateways (to connect to every scheduler) and
by schedulers (to find dead peers and to balance workers)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pagedserve.services.common.pb import engine_pb2 as pb
from pagedserve.services.common.signed_records import RecordCheck, SignedHash


def scheduler_registrations(check: RecordCheck) -> SignedHash[pb.SchedulerRegistration]:
    """The verified values of ``redis_keys.SCHEDULERS_HASH``: those signed with the cluster token and
    stored under their own id (others are refused once each, ``SignedHash``)."""
    return SignedHash(pb.SchedulerRegistration, check, lambda reg: reg.scheduler_id)


def live_only(registrations: Mapping[str, pb.SchedulerRegistration],
              leases: Sequence[bytes | None]) -> dict[str, pb.SchedulerRegistration]:
    """The registrations whose lease key holds their instance id (``leases`` in the same order,
    the values of ``redis_keys.scheduler_lease_key``; ``None`` where the key expired)."""
    return {sid: reg for (sid, reg), lease in zip(registrations.items(), leases)
            if lease is not None and lease == reg.instance_id.encode()}
