"""Names of everything pagedserve keeps in Redis, in one place."""

REQUEST_STREAM = "pagedserve:requests"
"""Stream of protobuf ``QueuedRequest`` records (field ``request``), written by gateways."""

REQUEST_FIELD = b"request"
"""The stream entry field that holds the encoded request."""

SCHEDULER_GROUP = "schedulers"
"""Consumer group on REQUEST_STREAM: an entry stays pending until its request finishes."""

WORKERS_HASH = "pagedserve:workers"
"""Hash worker id -> protobuf ``WorkerRegistration``."""


def worker_heartbeat_key(worker_id: str) -> str:
    """Key a worker refreshes with a TTL; the worker is considered gone once it expires."""
    return f"pagedserve:worker:{worker_id}:heartbeat"
