"""Prefix caching, forks with copy-on-write, and swapping in the block manager: exact block ids and
reference counts."""

import pytest

from pagedserve.engine.block_hash import hash_full_blocks
from pagedserve.engine.block_manager import BlockManager, NoFreeBlocksError
from pagedserve.engine.prefix_caching import PrefixCachingBlockManager


def tokens(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


def admit(bm, rid: str, prompt: list[int]) -> int:
    """Admits a prompt as the scheduler does; returns the cached tokens."""
    prefix = bm.find_cached_prefix(prompt)
    bm.allocate_slots(rid, len(prompt), prefix)
    bm.cache_full_blocks(rid, lambda: prompt, len(prompt))
    return prefix.num_tokens


def test_second_request_with_the_same_prefix_hits_its_full_blocks():
    bm = PrefixCachingBlockManager(num_blocks=10, block_size=4)
    assert admit(bm, "a", tokens(10)) == 0  # blocks 0, 1 full and cached; block 2 partial
    assert bm.block_table("a") == (0, 1, 2) and bm.num_cached_blocks == 2
    assert admit(bm, "b", tokens(9) + [7, 7]) == 8
    assert bm.block_table("b") == (0, 1, 3)
    assert [bm.ref_count(i) for i in range(4)] == [2, 2, 1, 1]
    assert (bm.num_queried_tokens, bm.num_hit_tokens) == (21, 8)


def test_freed_blocks_stay_cached_until_evicted_lru_tail_first():
    bm = PrefixCachingBlockManager(num_blocks=4, block_size=4)
    admit(bm, "a", tokens(12))  # blocks 0, 1, 2 all full
    bm.free("a")
    assert bm.free_block_ids() == [3, 2, 1, 0] and bm.num_cached_blocks == 3
    assert admit(bm, "b", tokens(12)) == 8  # a full hit keeps its last block to compute
    assert bm.block_table("b") == (0, 1, 3)
    bm.free("b")
    assert bm.free_block_ids() == [2, 3, 1, 0]
    bm.allocate_slots("c", 8)  # takes 2 (evicts its hash), then 3
    assert bm.block_table("c") == (2, 3) and bm.num_evictions == 1 and bm.num_cached_blocks == 2
    bm.free("c")
    assert bm.free_block_ids() == [1, 0, 3, 2]
    assert admit(bm, "d", tokens(12)) == 8  # blocks 0, 1 are still there
    assert bm.block_table("d") == (0, 1, 3)


def test_hits_that_sit_in_the_free_list_count_against_free_blocks():
    bm = PrefixCachingBlockManager(num_blocks=4, block_size=4)
    admit(bm, "a", tokens(8) + [1])
    bm.free("a")  # 3 free, two of them cached
    prefix = bm.find_cached_prefix(tokens(8) + [5, 5, 5, 5, 5, 5])
    assert prefix.num_tokens == 8 and prefix.num_free == 2
    assert bm.can_allocate("b", 14, prefix)  # 2 hits + 2 new of 4 free
    assert not bm.can_allocate("b", 17, prefix)


def test_cache_salt_separates_prefixes():
    bm = PrefixCachingBlockManager(num_blocks=8, block_size=4)
    prompt = tokens(9)
    bm.allocate_slots("a", 9)
    bm.cache_full_blocks("a", lambda: prompt, 9, extra=b"tenant-1")
    assert bm.find_cached_prefix(prompt, extra=b"tenant-2").num_tokens == 0
    assert bm.find_cached_prefix(prompt, extra=b"tenant-1").num_tokens == 8


def test_blocks_past_the_prompt_are_found_only_by_the_same_prompt_s_continuation():
    """A prompt of 6 and 7 generated tokens: its 3 full blocks are cached, the last two keyed as generated
    after 6 prompt tokens. The same sequence resumed (prompt 6) finds all 3 (its first 12 tokens alone: a full
    hit keeps its last block to compute, 8); the same tokens as a prompt (a chat's next turn) find only
    block 0, the one of prompt positions alone; so does the sequence after another prompt length."""
    bm = PrefixCachingBlockManager(num_blocks=10, block_size=4)
    sequence = tokens(13)
    bm.allocate_slots("a", 13)
    bm.cache_full_blocks("a", lambda: sequence, 13, num_prompt_tokens=6)
    assert bm.block_table("a") == (0, 1, 2, 3) and bm.num_cached_blocks == 3
    assert bm.find_cached_prefix(sequence + [5], num_prompt_tokens=6).num_tokens == 12
    assert bm.find_cached_prefix(sequence[:12], num_prompt_tokens=6).num_tokens == 8
    assert bm.find_cached_prefix(sequence + [5]).num_tokens == 4
    assert bm.find_cached_prefix(sequence[:8] + [5], num_prompt_tokens=9).num_tokens == 4
    assert bm.cached_prefix_length(sequence + [5], num_prompt_tokens=6) == 12
    assert bm.cached_prefix_length(sequence + [5], num_prompt_tokens=7) == 4  # another prompt's outputs


@pytest.mark.parametrize("salt", [b"|generated from 6", b"0||6", b"|6", b"6"])
def test_no_cache_salt_reads_as_another_salt_or_as_generated_tokens(salt):
    """A salt that spells an unsalted sequence's generated-block keys (the format of an earlier encoding,
    the separators of this one) finds nothing of it: a salt's length is in the hash."""
    bm = PrefixCachingBlockManager(num_blocks=10, block_size=4)
    sequence = tokens(13)
    bm.allocate_slots("a", 13)
    bm.cache_full_blocks("a", lambda: sequence, 13, num_prompt_tokens=6)
    assert bm.find_cached_prefix(sequence + [5], extra=salt).num_tokens == 0
    assert bm.find_cached_prefix(sequence + [5]).num_tokens == 4


def test_colliding_hashes_never_return_blocks_of_other_tokens():
    bm = PrefixCachingBlockManager(num_blocks=8, block_size=4, hash_fn=lambda data: b"same")
    admit(bm, "a", tokens(9))
    assert bm.find_cached_prefix(tokens(9, start=500)).num_tokens == 0  # same hash, other tokens
    assert bm.find_cached_prefix([100, 101, 102, 103, 9, 9, 9, 9, 9]).num_tokens <= 4


def test_a_hit_must_follow_the_chain_it_was_cached_on():
    bm = PrefixCachingBlockManager(num_blocks=8, block_size=2)
    admit(bm, "a", [1, 2, 3, 4, 5])  # blocks [1,2] <- [3,4]
    bm.free("a")
    bm.allocate_slots("x", 14)  # takes every free block: all of a's are evicted and rewritten
    bm.free("x")
    admit(bm, "b", [9, 9, 3, 4, 5])  # [3,4] is cached again, after another first block
    assert bm.find_cached_prefix([1, 2, 3, 4, 5]).num_tokens == 0


def test_fork_shares_blocks_and_copy_on_write_splits_the_partial_one():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate_slots("p", 6)  # blocks 0 (full), 1 (half)
    bm.fork("p", "c", 6)
    assert bm.block_table("c") == (0, 1) and [bm.ref_count(i) for i in (0, 1)] == [2, 2]
    assert bm.needs_copy_on_write("c", 6) and not bm.needs_copy_on_write("c", 8)
    assert bm.copy_on_write("c", 6) == ((1, 2),)
    assert bm.block_table("c") == (0, 2) and [bm.ref_count(i) for i in (0, 1, 2)] == [2, 1, 1]
    assert bm.copy_on_write("p", 6) == ()  # block 1 is p's alone now
    bm.free("p")
    bm.free("c")
    assert bm.num_free_blocks == 8


def test_swap_out_and_in_moves_tables_between_pools():
    bm = BlockManager(num_blocks=4, block_size=4, num_cpu_blocks=3)
    bm.allocate_slots("a", 9)  # blocks 0, 1, 2
    assert bm.swap_out("a") == ((0, 0), (1, 1), (2, 2))
    assert bm.block_table("a") == () and bm.cpu_block_table("a") == (0, 1, 2)
    assert bm.num_free_blocks == 4 and bm.num_free_cpu_blocks == 0
    bm.allocate_slots("b", 4)  # takes block 3
    assert bm.swap_in("a") == ((0, 2), (1, 1), (2, 0))  # freed tail first: 2, 1, 0 come back in that order
    assert bm.block_table("a") == (2, 1, 0) and bm.num_free_cpu_blocks == 3
    assert not BlockManager(4, 4).can_swap_out("a")
    with pytest.raises(NoFreeBlocksError):
        BlockManager(4, 4).swap_out("a")


def test_hash_chain_depends_on_the_whole_prefix():
    a = hash_full_blocks([1, 2, 3, 4], 2)
    b = hash_full_blocks([9, 9, 3, 4], 2)
    assert a[1].token_ids == b[1].token_ids and a[1].digest != b[1].digest


def test_only_slots_reaching_an_uncached_block_s_end_may_fill_one():
    bm, plain = PrefixCachingBlockManager(num_blocks=8, block_size=4), BlockManager(num_blocks=8, block_size=4)
    admit(bm, "a", tokens(6))  # block 0 cached, block 1 holds 2 of its 4 slots
    assert [bm.fills_uncached_block("a", n) for n in (4, 7, 8, 12)] == [False, False, True, True]
    bm.allocate_slots("a", 8)
    bm.cache_full_blocks("a", lambda: tokens(8), 8)
    assert not bm.fills_uncached_block("a", 8) and bm.num_cached_blocks == 2
    assert bm.fills_uncached_block("new", 4) and not bm.fills_uncached_block("new", 3)
    plain.allocate_slots("a", 8)
    assert not plain.fills_uncached_block("a", 8)  # nothing is cached without prefix caching
