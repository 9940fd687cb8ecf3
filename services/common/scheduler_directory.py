"""The live schedulers, as registered in Redis: read by gateways (to connect to every scheduler) and
by schedulers (to find dead peers and to balance workers)."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from google.protobuf.message import DecodeError

from services.common.auth import registration_is_signed
from services.common.pb import engine_pb2 as pb

log = logging.getLogger("pagedserve")


def verified_registrations(raw: Mapping[bytes, bytes], cluster_token: str) -> dict[str, pb.SchedulerRegistration]:
    """Decodes the values of ``redis_keys.SCHEDULERS_HASH``, keeping those signed with the cluster
    token and stored under their own id (others are logged and ignored)."""
    registrations = {}
    for key, value in raw.items():
        reg = pb.SchedulerRegistration()
        try:
            reg.ParseFromString(value)
        except DecodeError:
            reg = None
        if reg is None or not registration_is_signed(reg, cluster_token) or key != reg.scheduler_id.encode():
            log.warning("ignoring a scheduler registration under %r not signed with this cluster token", key)
            continue
        registrations[reg.scheduler_id] = reg
    return registrations


def live_only(registrations: Mapping[str, pb.SchedulerRegistration],
              leases: Sequence[bytes | None]) -> dict[str, pb.SchedulerRegistration]:
    """The registrations whose lease key holds their instance id (``leases`` in the same order,
    the values of ``redis_keys.scheduler_lease_key``; ``None`` where the key expired)."""
    return {sid: reg for (sid, reg), lease in zip(registrations.items(), leases)
            if lease is not None and lease == reg.instance_id.encode()}
