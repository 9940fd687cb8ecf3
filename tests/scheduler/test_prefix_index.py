"""The index of cached blocks shared by schedulers, and forwarding a request to the peer that caches
more of its prompt, with a real redis-server."""

from __future__ import annotations


from pagedserve.engine.block_hash import hash_block, hash_full_blocks
from pagedserve.engine.prefix_caching import PrefixCachingBlockManager
from pagedserve.services.common import redis_keys
from pagedserve.services.common.pb import engine_pb2 as pb
from pagedserve.services.scheduler.leases import Leases
from pagedserve.services.scheduler.prefix_index import MIN_GAIN_BLOCKS, PrefixIndex, cached_prefix_blocks
from pagedserve.services.scheduler.queue_consumer import RequestQueueConsumer
from tests.e2e.processes import CLUSTER_TOKEN, RECORDS

BLOCK = 4


def digests(tokens: list[int], salt: str = "") -> frozenset[bytes]:
    return frozenset(h.digest for h in hash_full_blocks(tokens, BLOCK, salt.encode()))


PROMPT = list(range(100, 124))  # 6 full blocks of 4


def request(tokens=PROMPT, salt: str = "") -> pb.QueuedRequest:
    return pb.QueuedRequest(request_id="r", prompt_token_ids=tokens, cache_salt=salt)


def test_leading_blocks_count_only_an_unbroken_prefix():
    assert [cached_prefix_blocks(p) for p in ([1, 1, 0, 1], [0, 1], [1, 1, 1], [])] == [2, 0, 3, 0]


def test_a_request_goes_to_the_peer_caching_more_of_its_prompt_unless_its_queue_is_longer(client):
    me, s1, s2 = (PrefixIndex(client, sid, BLOCK, 60, CLUSTER_TOKEN) for sid in ("me", "s1", "s2"))
    me.publish(digests(PROMPT[:4]))                   # 1 block
    s1.publish(digests(PROMPT[:12]))                  # 3 blocks
    s2.publish(digests(PROMPT[:20]))                  # 5 blocks
    assert me.better_peer(request(), {"s1": 0, "s2": 0}, most_load=0) == "s2"
    assert me.better_peer(request(), {"s1": 0, "s2": 5}, most_load=0) == "s1"  # s2 carries more than allowed
    assert me.better_peer(request(), {}, most_load=0) is None
    me.publish(digests(PROMPT[:16]))                  # 4 blocks: s2's one more is less than MIN_GAIN_BLOCKS
    assert MIN_GAIN_BLOCKS == 2 and me.better_peer(request(), {"s1": 0, "s2": 0}, most_load=0) is None
    assert me.better_peer(request(salt="other"), {"s2": 0}, most_load=0) is None  # salted: nothing shared
    s2.publish(frozenset())
    assert not client.exists(redis_keys.scheduler_blocks_key("s2"))


def published(client, scheduler_id: str) -> set[bytes]:
    return client.smembers(redis_keys.scheduler_blocks_key(scheduler_id))


def test_the_published_hashes_are_keyed_with_the_cluster_token_and_separated_by_the_cache_salt(client):
    """Issue #20, defect 5: the published hashes were the engine's plain SHA-256 block hashes; a
    reader of Redis recovered a 4-digit PIN in a cached prompt by hashing the 10,000 candidates."""
    for salt in ("tenant-1", "tenant-2"):  # the engine's cache, one salt each: as the scheduler publishes it
        blocks = PrefixCachingBlockManager(num_blocks=8, block_size=BLOCK)
        blocks.allocate_slots("r", len(PROMPT))
        blocks.cache_full_blocks("r", lambda: PROMPT, len(PROMPT), extra=salt.encode())
        PrefixIndex(client, salt, BLOCK, 60, CLUSTER_TOKEN).publish(frozenset(blocks.cached_digests()))
    one, two = published(client, "tenant-1"), published(client, "tenant-2")
    assert len(one) == len(two) == len(PROMPT) // BLOCK and not one & two
    plain = digests(PROMPT, "tenant-1") | digests(PROMPT, "tenant-2") | digests(PROMPT)
    assert hash_block(None, PROMPT[:BLOCK], b"tenant-1").digest in plain and not plain & (one | two)
    PrefixIndex(client, "other-cluster", BLOCK, 60, "another-cluster-token-0123456789").publish(
        digests(PROMPT, "tenant-1"))
    assert not published(client, "other-cluster") & one  # the token keys them
    me = PrefixIndex(client, "me", BLOCK, 60, CLUSTER_TOKEN)  # looked up keyed, as published
    assert me.better_peer(request(salt="tenant-1"), {"tenant-1": 0, "tenant-2": 0}, most_load=0) == "tenant-1"


def test_a_forwarded_entry_is_claimed_from_the_inbox_once_and_only_by_its_target(client):
    reader = RequestQueueConsumer(client, "s0", RECORDS)
    client.xadd(redis_keys.REQUEST_STREAM, {redis_keys.REQUEST_FIELD: RECORDS.sign(request())})
    entry = reader.read(count=10, block_ms=10)[0]
    s0, s1 = Leases(client, "s0", "i0", 3.0), Leases(client, "s1", "i1", 3.0)
    assert s0.take_own() and s1.take_own()
    assert not s1.forward(entry.entry_id, "s0")  # s1 does not hold it
    assert s0.forward(entry.entry_id, "s1")
    assert s0.claim_inbox(10) == []
    claimed = s1.claim_inbox(10)
    assert [e[0] for e in claimed] == [entry.entry_id] and s1.claim_inbox(10) == []
    pending = client.xpending_range(redis_keys.REQUEST_STREAM, redis_keys.SCHEDULER_GROUP, "-", "+", 10)
    assert [p["consumer"] for p in pending] == [b"s1"]
