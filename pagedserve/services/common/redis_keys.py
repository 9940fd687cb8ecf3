"""Names of everything pagedserve keeps in Redis, in one place."""

REQUEST_STREAM = "pagedserve:requests"
"""Stream of protobuf ``QueuedRequest`` records (field ``request``), written by gateways."""

def submission_key(submission_id: str) -> str:
    """Key marking one submission of a request to REQUEST_STREAM (value: its entry id, with a TTL), so
    that a command redis-py sends again queues nothing more; ``submission_id`` is random, drawn by the
    gateway for each submission."""
    return f"pagedserve:submission:{submission_id}"


REQUEST_FIELD = b"request"
"""The stream entry field that holds the encoded request."""

RESUME_FIELD = b"resume"
"""Present in an entry a scheduler queued again for a request it ran (Redis had forgotten the first
entry): whoever reads it resumes the request from the tokens its client received, as a claimed one."""

SCHEDULER_GROUP = "schedulers"
"""Consumer group on REQUEST_STREAM: an entry stays pending until its request finishes."""

WORKERS_HASH = "pagedserve:workers"
"""Hash worker id -> protobuf ``WorkerRegistration``."""


def worker_heartbeat_key(worker_id: str) -> str:
    """Key a worker refreshes with a TTL; the worker is considered gone once it expires."""
    return f"pagedserve:worker:{worker_id}:heartbeat"


SCHEDULERS_HASH = "pagedserve:schedulers"
"""Hash scheduler id -> protobuf ``SchedulerRegistration`` (signed with the cluster token)."""

HANDOFF_CONSUMER = "pagedserve:handoff"
"""Consumer in SCHEDULER_GROUP holding requests a scheduler gave up (it has no worker left); live
schedulers with workers claim them. Scheduler ids never contain ':', so none is called this."""


def scheduler_lease_key(scheduler_id: str) -> str:
    """Key a scheduler refreshes with a TTL (value: its instance id); it counts as dead once it expires."""
    return f"pagedserve:scheduler:{scheduler_id}:lease"


def worker_owner_key(worker_id: str) -> str:
    """Key holding the id of the scheduler that owns the worker (a lease with a TTL the owner renews)."""
    return f"pagedserve:worker:{worker_id}:owner"


def worker_epoch_key(worker_id: str) -> str:
    """Counter incremented each time the worker gets a new owner: the fencing token in its plans."""
    return f"pagedserve:worker:{worker_id}:epoch"


INBOX_PREFIX = "pagedserve:to:"
"""Consumers in SCHEDULER_GROUP named ``INBOX_PREFIX + scheduler id`` hold requests forwarded to that
scheduler (it caches more of their prompts); it claims them as new requests."""


def inbox_consumer(scheduler_id: str) -> str:
    """The consumer holding the requests forwarded to ``scheduler_id``."""
    return INBOX_PREFIX + scheduler_id


def scheduler_blocks_key(scheduler_id: str) -> str:
    """Set of the content hashes of the KV blocks cached on the scheduler's workers (a TTL it renews)."""
    return f"pagedserve:scheduler:{scheduler_id}:blocks"
