"""The index of cached blocks that schedulers share, and the forwarding of a request to the scheduler
that caches most of its prompt (prefix-aware placement across schedulers, as NVIDIA Dynamo's
KV-aware router does across workers).

Each scheduler publishes the content hashes of the prompt blocks cached on its workers (a Redis set
per scheduler, refreshed every tick while it changes, with the lease TTL), keyed with the cluster
token (``signed_records.BlockDigestKey``): the engine's hashes are plain SHA-256 chained over the
prompt and its cache salt, and would let a reader of Redis confirm a guessed prompt. A scheduler that reads a
new request looks its prompt's block hashes up in its own set and its peers': when a peer holds at
least ``MIN_GAIN_BLOCKS`` more leading blocks and has no longer queue, the request is moved to that
peer's inbox consumer (``redis_keys.inbox_consumer``), which the peer claims as a new request.
Within a scheduler, ``--placement prefix`` then picks the worker.
"""

from __future__ import annotations

from collections.abc import Mapping

import redis

from pagedserve.engine.block_hash import hash_full_blocks
from pagedserve.services.common import redis_keys
from pagedserve.services.common.pb import engine_pb2 as pb
from pagedserve.services.common.signed_records import BlockDigestKey

MIN_GAIN_BLOCKS = 2
"""A peer must cache at least this many more leading blocks of a prompt for the request to move."""

MAX_LOOKUP_BLOCKS = 512
"""Most leading blocks of a prompt looked up (8,192 tokens at block size 16)."""


def cached_prefix_blocks(present: list) -> int:
    """Leading blocks found, from ``SMISMEMBER``'s answer (1 = present) for a prompt's block hashes."""
    count = 0
    for found in present:
        if not found:
            break
        count += 1
    return count


class PrefixIndex:
    """This scheduler's view of the shared index.

    Args:
        client: a Redis client (bytes responses).
        scheduler_id: this scheduler's id.
        block_size: tokens per block (the workers' and every scheduler's).
        ttl_s: how long a published set lives without a refresh, seconds (the lease TTL).
        cluster_token: keys the published hashes.
    """

    def __init__(self, client: redis.Redis, scheduler_id: str, block_size: int, ttl_s: float,
                 cluster_token: str) -> None:
        self._client = client
        self._key = BlockDigestKey(cluster_token)
        self._keyed: dict[bytes, bytes] = {}  # engine digest -> published value, of the set published last
        self._id = scheduler_id
        self._block_size = block_size
        self._ttl_ms = int(ttl_s * 1000)
        self._published: frozenset[bytes] | None = None

    def publish(self, digests: frozenset[bytes]) -> None:
        """Replaces this scheduler's set (the keyed ``digests``) when it changed, else only renews its TTL.

        Raises:
            redis.RedisError: Redis unreachable.
        """
        key = redis_keys.scheduler_blocks_key(self._id)
        pipe = self._client.pipeline()
        keyed = self._keyed
        if digests != self._published:
            keyed = {d: self._keyed.get(d) or self._key(d) for d in digests}
            pipe.delete(key)
            if keyed:
                pipe.sadd(key, *keyed.values())
        pipe.pexpire(key, self._ttl_ms)
        pipe.execute()
        self._published, self._keyed = digests, keyed

    def better_peer(self, request: pb.QueuedRequest, peers: Mapping[str, int], most_load: int) -> str | None:
        """The peer that caches ``MIN_GAIN_BLOCKS`` or more leading blocks of the request's prompt
        than this scheduler, among those whose load is at most ``most_load`` (``peers``: id -> its
        load, waiting plus running); the one with the most such blocks, ties by id. None: keep
        the request.

        Raises:
            redis.RedisError: Redis unreachable.
        """
        if not peers:
            return None
        tokens = list(request.prompt_token_ids[:MAX_LOOKUP_BLOCKS * self._block_size])
        blocks = hash_full_blocks(tokens, self._block_size, request.cache_salt.encode())
        digests = [self._key(h.digest) for h in blocks]
        if len(digests) < MIN_GAIN_BLOCKS:
            return None
        candidates = [self._id, *sorted(p for p, load in peers.items() if load <= most_load)]
        pipe = self._client.pipeline()
        for scheduler_id in candidates:
            pipe.smismember(redis_keys.scheduler_blocks_key(scheduler_id), digests)
        found = [cached_prefix_blocks(present) for present in pipe.execute()]
        best = max(range(1, len(candidates)), key=lambda i: found[i], default=None)
        if best is None or found[best] - found[0] < MIN_GAIN_BLOCKS:
            return None
        return candidates[best]
