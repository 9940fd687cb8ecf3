"""Leases in Redis that keep several schedulers apart.

- A scheduler is alive while its lease key (``redis_keys.scheduler_lease_key``, value: its instance
  id) exists; it renews the key every tick and takes it again when it finds it gone (Redis
  restarted, or it was cut off longer than the TTL). Requests a survivor took over meanwhile are
  fenced by the gateways, which accept a request's tokens only from the scheduler they resumed it
  with, and abort it on the other.
- A worker is driven by the one scheduler whose id its owner key holds (a lease with the same
  TTL). Each new owner gets a larger epoch (Redis's clock in microseconds, and above the last
  epoch: it still grows after Redis restarts empty); the epoch travels in every plan
  (``BatchPlan.lease_epoch``) and the worker refuses plans of an epoch older than one it has run,
  so a scheduler that lost its lease cannot drive the worker any more (a fencing token, as in
  Kleppmann's "How to do distributed locking", 2016).
- The pending requests of a dead scheduler (its consumer in the group, with no lease) are claimed
  by a live one, atomically with the check that the lease is gone, so a scheduler restarting under
  the same name and a survivor never both take one entry.

All check-and-set steps are Lua scripts: Redis runs each one atomically.
"""

from __future__ import annotations

import redis

from pagedserve.services.common import redis_keys
from pagedserve.services.scheduler.queue_consumer import QueueEntry

_ACQUIRE_WORKER = """
if redis.call('GET', KEYS[3]) ~= ARGV[4] then
  return -1  -- this scheduler's own lease is gone (Redis restarted empty, or it was cut off)
end
if not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return 0
end
local now = redis.call('TIME')
local epoch = tonumber(now[1]) * 1000000 + tonumber(now[2])
local previous = tonumber(redis.call('GET', KEYS[2]) or '0')
if not previous or previous ~= previous or previous >= 2^52 then
  previous = 0  -- not an epoch of ours (anyone who can write to Redis could put it there)
end
if epoch <= previous then
  epoch = previous + 1
end
redis.call('SET', KEYS[2], epoch, 'PX', ARGV[3])
return epoch
"""

_RENEW_WORKER = """
local owner = redis.call('GET', KEYS[1])
local epoch = redis.call('GET', KEYS[2])
if owner == ARGV[1] and epoch == ARGV[3] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  redis.call('PEXPIRE', KEYS[2], ARGV[4])
  return 1
end
if not owner and (not epoch or epoch == ARGV[3]) then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  redis.call('SET', KEYS[2], ARGV[3], 'PX', ARGV[4])
  return 1
end
return 0
"""

_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

_FORGET_CONSUMER = """
if redis.call('EXISTS', KEYS[2]) == 1 then
  return 0
end
local pending = redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 1, ARGV[2])
if #pending > 0 then
  return 0
end
redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2])
redis.call('HDEL', KEYS[3], ARGV[2])
return 1
"""

_TAKE_SCHEDULER = """
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
if holder then
  return 0
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""

_RENEW_SCHEDULER = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""

_CLAIM_PENDING = """
if redis.call('GET', KEYS[3]) ~= ARGV[6] then
  return -1  -- the claiming scheduler's own lease is gone (Redis restarted empty, or it was cut off)
end
local lease = redis.call('GET', KEYS[2])
if lease and (ARGV[5] == '' or lease == ARGV[5]) then
  return {}
end
local pending = redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', tonumber(ARGV[4]), ARGV[2])
if #pending == 0 then
  return {}
end
local ids = {}
for i, entry in ipairs(pending) do
  ids[i] = entry[1]
end
local now = redis.call('TIME')
return {now[1], now[2], redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[3], 0, unpack(ids))}
"""


_FORWARD = """
local pending = redis.pcall('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1)
if not pending.err and #pending > 0 and pending[1][2] == ARGV[2] then
  redis.call('XCLAIM', KEYS[1], ARGV[1], KEYS[2], 0, ARGV[3], 'JUSTID')
  return 1
end
return 0
"""

_HAND_OFF = """
local requeued = 0
for i = 5, #ARGV, 2 do
  local pending = redis.pcall('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if pending.err or #pending == 0 then  -- Redis forgot the entry (restarted empty): queue it again
    redis.call('XADD', KEYS[1], '*', ARGV[3], ARGV[i + 1], ARGV[4], '1')
    requeued = requeued + 1
  elseif pending[1][2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], KEYS[2], 0, ARGV[i], 'JUSTID')
  end
end
return requeued
"""


EPOCH_TTL_S = 7 * 24 * 3600.0
"""How long a worker's epoch key outlives the last lease on it, seconds (worker ids are often new
at every start: without a TTL, one key per worker ever started would stay in Redis). Epochs come
from Redis's clock, so a worker that returns after its key expired still gets a larger one."""
_EPOCH_TTL_MS = int(EPOCH_TTL_S * 1000)


class OwnLeaseLost(Exception):
    """This scheduler's own lease was gone when a step that needs it ran."""


class Leases:
    """The lease operations of one scheduler.

    Args:
        client: a Redis client (bytes responses).
        scheduler_id: this scheduler's id (its consumer name).
        instance_id: new at each start of the process (kept when the lease is lost and taken again).
        ttl_s: lease time to live, seconds; renew well within it.
    """

    def __init__(self, client: redis.Redis, scheduler_id: str, instance_id: str, ttl_s: float) -> None:
        self._client = client
        self.scheduler_id = scheduler_id
        self.instance_id = instance_id
        self._ttl_ms = int(ttl_s * 1000)
        self._acquire_worker = client.register_script(_ACQUIRE_WORKER)
        self._renew_worker = client.register_script(_RENEW_WORKER)
        self._release = client.register_script(_RELEASE)
        self._take_scheduler = client.register_script(_TAKE_SCHEDULER)
        self._renew_scheduler = client.register_script(_RENEW_SCHEDULER)
        self._claim = client.register_script(_CLAIM_PENDING)
        self._forget = client.register_script(_FORGET_CONSUMER)
        self._forward = client.register_script(_FORWARD)
        self._hand_off = client.register_script(_HAND_OFF)

    # ---- this scheduler ---------------------------------------------------------------
    def take_own(self) -> bool:
        """Takes this scheduler's lease; False while another live process holds the same id. Taking it
        when it already holds this instance id renews it: a take whose reply was lost (redis-py retries
        it) must not read as someone else's lease, which kept the scheduler waiting a TTL."""
        key = redis_keys.scheduler_lease_key(self.scheduler_id)
        return bool(self._take_scheduler(keys=[key], args=[self.instance_id, self._ttl_ms]))

    def renew_own(self) -> bool:
        """Extends this scheduler's lease; False when it was lost (expired, or taken by another)."""
        key = redis_keys.scheduler_lease_key(self.scheduler_id)
        return bool(self._renew_scheduler(keys=[key], args=[self.instance_id, self._ttl_ms]))

    def release_own(self) -> None:
        """Gives up this scheduler's lease now (a clean stop: peers take over at once)."""
        self._release(keys=[redis_keys.scheduler_lease_key(self.scheduler_id)], args=[self.instance_id])

    # ---- workers ----------------------------------------------------------------------
    def acquire_worker(self, worker_id: str) -> int:
        """Takes an unowned worker, atomically with the check that this scheduler still holds its own
        lease. Returns the worker's new epoch (> 0), or 0 when it has an owner.

        Raises:
            OwnLeaseLost: this scheduler's lease key is gone or holds another instance: Redis may
                have restarted empty since the lease was last renewed, and an unowned worker may
                then be a live peer's whose lease Redis forgot.
        """
        keys = [redis_keys.worker_owner_key(worker_id), redis_keys.worker_epoch_key(worker_id),
                redis_keys.scheduler_lease_key(self.scheduler_id)]
        epoch = int(self._acquire_worker(keys=keys, args=[self.scheduler_id, self._ttl_ms, _EPOCH_TTL_MS,
                                                            self.instance_id]))
        if epoch < 0:
            raise OwnLeaseLost(f"scheduler {self.scheduler_id}'s lease is gone; no worker taken")
        return epoch

    def renew_worker(self, worker_id: str, epoch: int) -> bool:
        """Extends the lease this scheduler holds on a worker under ``epoch``. When the lease is
        gone and no one took the worker since (Redis restarted empty), takes it again under the same
        epoch, so the worker's sequences go on. False when another owner has (or had) it."""
        keys = [redis_keys.worker_owner_key(worker_id), redis_keys.worker_epoch_key(worker_id)]
        return bool(self._renew_worker(keys=keys, args=[self.scheduler_id, self._ttl_ms, epoch, _EPOCH_TTL_MS]))

    def release_worker(self, worker_id: str) -> None:
        """Gives a worker up (if still ours) so that another scheduler may take it at once."""
        self._release(keys=[redis_keys.worker_owner_key(worker_id)], args=[self.scheduler_id])

    def owners(self, worker_ids: list[str]) -> list[str | None]:
        """The owner of each worker, in order (``None``: unowned)."""
        if not worker_ids:
            return []
        values = self._client.mget([redis_keys.worker_owner_key(w) for w in worker_ids])
        return [v.decode(errors="replace") if v is not None else None for v in values]

    # ---- requests ---------------------------------------------------------------------
    def claim_pending(self, consumer: str, lease_key: str, count: int, owner_instance: str = "") -> tuple[int, list]:
        """Moves up to ``count`` pending entries of ``consumer`` to this scheduler, unless its owner
        is alive: ``lease_key`` exists and, when ``owner_instance`` (the instance id of the owner's
        signed registration) is given, holds it. A lease key holding anything else was written by
        someone without the cluster token: its owner cannot hold its lease, and its entries would
        otherwise wait for ever. Returns Redis's clock at the claim (microseconds; 0 when nothing
        was claimed) and the entries as ``XCLAIM`` does: a list of ``(entry id, fields)``; entries
        deleted from the stream meanwhile are dropped by Redis.

        Raises:
            OwnLeaseLost: this scheduler's own lease is gone (checked in the same script), so that
                one that has not noticed a restart of Redis takes no live peer's requests.
        """
        keys = [redis_keys.REQUEST_STREAM, lease_key, redis_keys.scheduler_lease_key(self.scheduler_id)]
        args = [redis_keys.SCHEDULER_GROUP, consumer, self.scheduler_id, count, owner_instance, self.instance_id]
        reply = self._claim(keys=keys, args=args)
        if reply == -1:
            raise OwnLeaseLost(f"scheduler {self.scheduler_id}'s lease is gone; nothing claimed")
        if not reply:
            return 0, []
        seconds, micros, claimed = reply
        return int(seconds) * 1_000_000 + int(micros), [(e[0], _fields(e[1])) for e in claimed if e]

    def forget_consumer(self, consumer: str, lease_key: str) -> bool:
        """Deletes a dead scheduler's consumer and registration if it holds nothing pending and
        ``lease_key`` does not exist, in one step (a scheduler restarting under that id takes its
        lease before reading: it never loses entries it read in between). True if forgotten."""
        keys = [redis_keys.REQUEST_STREAM, lease_key, redis_keys.SCHEDULERS_HASH]
        return bool(self._forget(keys=keys, args=[redis_keys.SCHEDULER_GROUP, consumer]))

    def forward(self, entry_id: bytes, scheduler_id: str) -> bool:
        """Moves an entry this scheduler holds to ``scheduler_id``'s inbox (it caches more of the
        prompt). False when this scheduler no longer holds it."""
        keys = [redis_keys.REQUEST_STREAM, redis_keys.inbox_consumer(scheduler_id)]
        return bool(self._forward(keys=keys, args=[redis_keys.SCHEDULER_GROUP, self.scheduler_id, entry_id]))

    def claim_inbox(self, count: int) -> list:
        """Takes up to ``count`` requests peers forwarded to this scheduler; ``(entry id, fields)`` pairs."""
        inbox = redis_keys.inbox_consumer(self.scheduler_id)
        return self.claim_pending(inbox, redis_keys.scheduler_lease_key(inbox), count)[1]  # that key never exists

    def hand_off(self, entries: list[QueueEntry]) -> int:
        """Moves this scheduler's pending entries to the hand-off consumer, for a scheduler with
        workers to claim; entries another consumer holds now (taken over while this one was cut
        off) stay where they are; a request whose entry Redis no longer has (it restarted empty)
        is queued again, marked to be resumed (``redis_keys.RESUME_FIELD``): every request handed
        off reaches a scheduler that runs it. Returns how many were queued again."""
        if not entries:
            return 0
        args = [redis_keys.SCHEDULER_GROUP, self.scheduler_id, redis_keys.REQUEST_FIELD, redis_keys.RESUME_FIELD]
        for entry in entries:
            args += [entry.entry_id, entry.request.SerializeToString()]
        return int(self._hand_off(keys=[redis_keys.REQUEST_STREAM, redis_keys.HANDOFF_CONSUMER], args=args))

def _fields(raw) -> dict[bytes, bytes]:
    """XCLAIM's field list ``[k1, v1, k2, v2, ...]`` as a dict."""
    if isinstance(raw, dict):
        return raw
    return dict(zip(raw[::2], raw[1::2]))
