"""Block pool and block manager: exact block ids, reference counts, no leaks."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.engine.block_manager import BlockManager, NoFreeBlocksError, blocks_for_tokens
from pagedserve.engine.block_pool import BlockPool, FreeBlockQueue, Block


def test_blocks_for_tokens():
    assert [blocks_for_tokens(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_free_queue_pop_append_remove_in_o1_order():
    blocks = [Block(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    assert queue.block_ids() == [0, 1, 2, 3, 4]
    queue.remove(blocks[2])
    assert queue.block_ids() == [0, 1, 3, 4] and len(queue) == 4
    assert queue.popleft() is blocks[0]
    queue.remove(blocks[4])  # the tail
    queue.append(blocks[2])
    assert queue.block_ids() == [1, 3, 2]
    with pytest.raises(ValueError):
        queue.remove(blocks[4])
    for _ in range(3):
        queue.popleft()
    with pytest.raises(NoFreeBlocksError):
        queue.popleft()


def test_allocate_grows_table_with_exact_ids():
    bm = BlockManager(num_blocks=8, block_size=4)
    assert bm.allocate_slots("a", 5) == (0, 1)
    assert bm.allocate_slots("b", 4) == (2,)
    assert bm.allocate_slots("a", 8) == ()  # block 1 still has room
    assert bm.allocate_slots("a", 9) == (3,)
    assert bm.block_table("a") == (0, 1, 3)
    assert [bm.ref_count(i) for i in range(8)] == [1, 1, 1, 1, 0, 0, 0, 0]
    assert bm.num_free_blocks == 4


def test_free_returns_tail_first_and_reuses_oldest_freed():
    bm = BlockManager(num_blocks=6, block_size=2)
    bm.allocate_slots("a", 6)  # blocks 0,1,2
    bm.allocate_slots("b", 2)  # block 3
    bm.free("a")
    assert bm.free_block_ids() == [4, 5, 2, 1, 0]
    assert [bm.ref_count(i) for i in range(6)] == [0, 0, 0, 1, 0, 0]
    assert bm.allocate_slots("c", 6) == (4, 5, 2)
    bm.free("a")  # freeing twice is harmless
    assert bm.num_free_blocks == 2


def test_can_allocate_and_out_of_blocks_leaves_table_unchanged():
    bm = BlockManager(num_blocks=3, block_size=4)
    bm.allocate_slots("a", 8)
    assert bm.can_allocate("a", 12) and not bm.can_allocate("a", 13)
    assert not bm.can_allocate("b", 5)
    with pytest.raises(NoFreeBlocksError):
        bm.allocate_slots("b", 5)
    assert bm.block_table("b") == () and bm.num_free_blocks == 1


def test_pool_rejects_double_release_and_bad_sizes():
    pool = BlockPool(2)
    (block,) = pool.take(1)
    pool.release([block])
    with pytest.raises(ValueError):
        pool.release([block])
    with pytest.raises(ValueError):
        BlockPool(0)
    with pytest.raises(ValueError):
        BlockManager(4, 0)


operations = st.lists(
    st.tuples(st.sampled_from(["alloc", "append", "free"]), st.integers(0, 5), st.integers(1, 40)),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(operations)
def test_random_operations_never_leak_or_share_blocks(ops):
    bm = BlockManager(num_blocks=16, block_size=4)
    sizes: dict[str, int] = {}
    for op, seq, amount in ops:
        rid = f"r{seq}"
        target = amount if op == "alloc" else sizes.get(rid, 0) + amount
        if op == "free":
            bm.free(rid)
            sizes.pop(rid, None)
        elif target > sizes.get(rid, 0) and bm.can_allocate(rid, target):
            bm.allocate_slots(rid, target)
            sizes[rid] = target
        held = [b for r in sizes for b in bm.block_table(r)]
        assert len(held) == len(set(held)), "a block is in two tables"
        for rid_, size in sizes.items():
            assert len(bm.block_table(rid_)) == blocks_for_tokens(size, 4)
        assert sorted(held + bm.free_block_ids()) == list(range(16))
        assert all(bm.ref_count(b) == 1 for b in held)
        assert all(bm.ref_count(b) == 0 for b in bm.free_block_ids())
    for rid in list(sizes):
        bm.free(rid)
    assert bm.num_free_blocks == 16
