"""Bounds shared by a service and the services that call it."""

MAX_HELD_QUERY_IDS = 1024
"""Most request ids in one ``Scheduler.HeldRequests`` call: a gateway asks in batches of at most
this many, and a scheduler refuses a longer list with INVALID_ARGUMENT."""

MAX_LEASE_TTL_S = 600.0
"""Longest ``--lease-ttl`` a scheduler accepts, seconds; a gateway counts no registered TTL as longer (it waits
that long, plus the takeover, before failing a lost scheduler's requests)."""
