"""Bounds shared by a service and the services that call it."""

MAX_HELD_QUERY_IDS = 1024
"""Most request ids in one ``Scheduler.HeldRequests`` call: a gateway asks in batches of at most
this many, and a scheduler refuses a longer list with INVALID_ARGUMENT."""
