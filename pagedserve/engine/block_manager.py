"""Block manager: the block tables of one worker's sequences (one table per sample: keyed by ``SequenceId``), and
the only caller of the block pool's reference-count operations (``BlockPool.take``, ``touch``, ``release``).

PagedAttention (Kwon et al., SOSP 2023, §4.2-4.4): a sequence's KV cache lives in fixed-size
blocks that need not be contiguous; its block table maps logical block i (token positions
``[i * block_size, (i + 1) * block_size)``) to a physical block id. Blocks are allocated as the
sequence grows, shared by reference count between sequences with the same prefix (forked samples,
cached prompts), copied on write when a shared, partly filled block is written, and swapped to
CPU blocks under memory pressure. ``pagedserve/engine/prefix_caching.py`` adds automatic prefix
caching on top.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedserve.engine.block_pool import Block, BlockPool, NoFreeBlocksError

if TYPE_CHECKING:
    from pagedserve.engine.messages import SequenceId


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """Number of blocks that hold ``num_tokens`` token slots (ceiling division)."""
    return -(-num_tokens // block_size)


@dataclass(frozen=True)
class CachedPrefix:
    """Cached full blocks that hold the start of a prompt (found, not yet taken).

    Attributes:
        blocks: the blocks, in order.
        num_tokens: tokens they hold (``len(blocks) * block_size``).
    """

    blocks: tuple[Block, ...] = ()
    num_tokens: int = 0

    @property
    def num_free(self) -> int:
        """Hits that sit in the free list: taking them makes that many fewer blocks free."""
        return sum(1 for block in self.blocks if block.ref_count == 0)


NO_PREFIX = CachedPrefix()


class BlockManager:
    """Allocates, shares, copies, swaps and frees the blocks of one worker, by sequence: one block table per
    ``SequenceId`` (a request's ``n`` samples hold tables of their own, sharing blocks after a fork).

    Args:
        num_blocks: the worker's KV capacity in blocks.
        block_size: token slots per block.
        num_cpu_blocks: CPU blocks for swap preemption (0: no swapping).

    Raises:
        ValueError: a non-positive size.
    """

    def __init__(self, num_blocks: int, block_size: int, num_cpu_blocks: int = 0) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.block_size = block_size
        self._pool = BlockPool(num_blocks)
        self._cpu_pool = BlockPool(num_cpu_blocks) if num_cpu_blocks > 0 else None
        self._tables: dict[SequenceId, list[Block]] = {}
        self._swapped: dict[SequenceId, list[Block]] = {}
        self.num_queried_tokens = 0  # prefix-cache lookups, in tokens (stay 0 without prefix caching)
        self.num_hit_tokens = 0

    @property
    def num_blocks(self) -> int:
        return self._pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self._pool.num_free_blocks

    @property
    def num_free_cpu_blocks(self) -> int:
        return self._cpu_pool.num_free_blocks if self._cpu_pool else 0

    @property
    def num_cached_blocks(self) -> int:
        """Blocks findable by their hash (0 without prefix caching)."""
        return self._pool.num_cached_blocks

    @property
    def num_evictions(self) -> int:
        return self._pool.num_evictions

    def cached_digests(self) -> list[bytes]:
        """Content hashes of the blocks findable by hash (none without prefix caching)."""
        return self._pool.cached_digests()

    # ---- allocation ----------------------------------------------------------------------
    def find_cached_prefix(self, token_ids: Sequence[int], extra: bytes = b"",
                           num_prompt_tokens: int | None = None) -> CachedPrefix:
        """Cached blocks holding the start of ``token_ids``; none without prefix caching."""
        return NO_PREFIX

    def num_new_blocks(self, seq_id: SequenceId, num_tokens: int, prefix: CachedPrefix = NO_PREFIX) -> int:
        """Blocks to take from the free list so the sequence's table holds ``num_tokens`` slots."""
        held = len(self._tables.get(seq_id, ())) + len(prefix.blocks)
        return max(0, blocks_for_tokens(num_tokens, self.block_size) - held)

    def can_allocate(self, seq_id: SequenceId, num_tokens: int, prefix: CachedPrefix = NO_PREFIX) -> bool:
        """Whether the table can grow to ``num_tokens`` slots (after taking ``prefix``) right now."""
        return self.num_new_blocks(seq_id, num_tokens, prefix) <= self._pool.num_free_blocks - prefix.num_free

    def allocate_slots(self, seq_id: SequenceId, num_tokens: int, prefix: CachedPrefix = NO_PREFIX) -> tuple[int, ...]:
        """Grows (or creates) the sequence's table to hold ``num_tokens`` slots in all.

        This is both "allocate" for a new sequence (taking the cached ``prefix`` first) and
        "append slots" for a running one.

        Returns:
            The ids of the blocks taken from the free list, in table order.

        Raises:
            NoFreeBlocksError: too few free blocks; the table is unchanged.
        """
        if not self.can_allocate(seq_id, num_tokens, prefix):
            raise NoFreeBlocksError(f"sequence {seq_id} cannot grow to {num_tokens} slots")
        count = self.num_new_blocks(seq_id, num_tokens, prefix)
        if prefix.blocks:
            self._pool.touch(list(prefix.blocks))
            self._tables.setdefault(seq_id, []).extend(prefix.blocks)
        return self.allocate_blocks(seq_id, count)

    def allocate_blocks(self, seq_id: SequenceId, count: int) -> tuple[int, ...]:
        """Appends ``count`` free blocks to the sequence's table (creating it); returns their ids.

        Raises:
            NoFreeBlocksError: fewer than ``count`` blocks are free; the table is unchanged.
        """
        new_blocks = self._pool.take(count)
        self._tables.setdefault(seq_id, []).extend(new_blocks)
        return tuple(block.block_id for block in new_blocks)

    def truncate(self, seq_id: SequenceId, num_tokens: int) -> None:
        """Frees the blocks of the sequence's table past those holding its first ``num_tokens`` slots,
        tail first (the slots speculative decoding reserved for drafts it rejected). Never cached:
        only computed slots with known tokens are (``cache_full_blocks``)."""
        table = self._tables.get(seq_id, [])
        keep = blocks_for_tokens(num_tokens, self.block_size)
        if len(table) > keep:
            tail = table[keep:]
            del table[keep:]
            self._pool.release(tail[::-1])

    def fills_uncached_block(self, seq_id: SequenceId, num_tokens: int) -> bool:
        """Whether the sequence's first ``num_tokens`` slots may fill a block not cached yet (never here):
        the cheap question asked before ``cache_full_blocks``, which needs the tokens (and caches only
        blocks the sequence holds)."""
        return False

    def cache_full_blocks(self, seq_id: SequenceId, token_ids: Callable[[], Sequence[int]], num_tokens: int,
                          extra: bytes = b"", num_prompt_tokens: int | None = None) -> None:
        """Makes the sequence's full blocks among its first ``num_tokens`` slots findable (no-op here)."""

    def cached_prefix_length(self, token_ids: Sequence[int], extra: bytes = b"",
                             num_prompt_tokens: int | None = None) -> int:
        """Tokens of ``token_ids`` whose blocks are cached here (none without prefix caching)."""
        return 0

    # ---- sharing -------------------------------------------------------------------------
    def fork(self, parent_id: str, child_id: str, num_tokens: int) -> None:
        """Gives ``child_id`` the parent's blocks holding its first ``num_tokens`` slots, by reference
        (parallel sampling).

        Raises:
            ValueError: the child already holds blocks.
        """
        if child_id in self._tables:
            raise ValueError(f"sequence {child_id} already holds blocks")
        blocks = list(self._tables.get(parent_id, ()))[:blocks_for_tokens(num_tokens, self.block_size)]
        self._pool.touch(blocks)
        self._tables[child_id] = blocks

    def needs_copy_on_write(self, seq_id: SequenceId, first_write: int) -> bool:
        """Whether writing slot ``first_write`` lands in a block other tables also hold."""
        table = self._tables.get(seq_id, [])
        index = first_write // self.block_size
        return index < len(table) and table[index].ref_count > 1

    def copy_on_write(self, seq_id: SequenceId, first_write: int) -> tuple[tuple[int, int], ...]:
        """Gives the request its own copy of the shared block that slot ``first_write`` lands in.

        Returns:
            ``((source block, new block),)`` for the worker to copy, or ``()`` when not shared.

        Raises:
            NoFreeBlocksError: no free block for the copy.
        """
        if not self.needs_copy_on_write(seq_id, first_write):
            return ()
        table = self._tables[seq_id]
        index = first_write // self.block_size
        (copy,) = self._pool.take(1)
        shared, table[index] = table[index], copy
        self._pool.release([shared])
        return ((shared.block_id, copy.block_id),)

    # ---- swapping ------------------------------------------------------------------------
    def can_swap_out(self, seq_id: SequenceId) -> bool:
        return self._cpu_pool is not None and len(self._tables.get(seq_id, ())) <= self._cpu_pool.num_free_blocks

    def swap_out(self, seq_id: SequenceId) -> tuple[tuple[int, int], ...]:
        """Moves the sequence's table to CPU blocks and frees its device blocks.

        Returns:
            ``(device block, cpu block)`` pairs for the worker to copy before the blocks are reused.

        Raises:
            NoFreeBlocksError: too few CPU blocks (check ``can_swap_out``).
        """
        if not self.can_swap_out(seq_id):
            raise NoFreeBlocksError(f"no CPU room to swap out {seq_id!r}")
        device = self._tables.pop(seq_id)
        cpu = self._cpu_pool.take(len(device))
        self._swapped[seq_id] = cpu
        self._pool.release(device[::-1])
        return tuple((d.block_id, c.block_id) for d, c in zip(device, cpu))

    def can_swap_in(self, seq_id: SequenceId) -> bool:
        return len(self._swapped.get(seq_id, ())) <= self._pool.num_free_blocks

    def swap_in(self, seq_id: SequenceId) -> tuple[tuple[int, int], ...]:
        """Moves a swapped-out sequence back to device blocks.

        Returns:
            ``(cpu block, device block)`` pairs for the worker to copy before the step runs.

        Raises:
            NoFreeBlocksError: too few device blocks (check ``can_swap_in``).
        """
        cpu = self._swapped[seq_id]
        device = self._pool.take(len(cpu))
        del self._swapped[seq_id]
        self._tables[seq_id] = device
        self._cpu_pool.release(cpu[::-1])
        return tuple((c.block_id, d.block_id) for c, d in zip(cpu, device))

    def is_swapped(self, seq_id: SequenceId) -> bool:
        return seq_id in self._swapped

    # ---- release and inspection ----------------------------------------------------------
    def free(self, seq_id: SequenceId) -> None:
        """Drops the sequence's table (device or swapped) and its reference to each block, tail first.

        Unknown ids are ignored, so freeing twice is harmless.
        """
        blocks = self._tables.pop(seq_id, None)
        if blocks:
            self._pool.release(blocks[::-1])
        cpu = self._swapped.pop(seq_id, None)
        if cpu:
            self._cpu_pool.release(cpu[::-1])

    def block_table(self, seq_id: SequenceId) -> tuple[int, ...]:
        """The request's physical block ids in logical order (empty when it holds none)."""
        return tuple(block.block_id for block in self._tables.get(seq_id, ()))

    def cpu_block_table(self, seq_id: SequenceId) -> tuple[int, ...]:
        return tuple(block.block_id for block in self._swapped.get(seq_id, ()))

    def ref_count(self, block_id: int) -> int:
        """How many block tables hold ``block_id``."""
        return self._pool.blocks[block_id].ref_count

    def free_block_ids(self) -> list[int]:
        """Free block ids, next to be allocated first (O(n): for tests and debugging)."""
        return self._pool.free_queue.block_ids()

    def free_cpu_block_ids(self) -> list[int]:
        return self._cpu_pool.free_queue.block_ids() if self._cpu_pool else []

    def seq_ids(self) -> list[SequenceId]:
        """Sequences that hold device blocks."""
        return list(self._tables)

    def swapped_seq_ids(self) -> list[SequenceId]:
        return list(self._swapped)


__all__ = ["BlockManager", "CachedPrefix", "NO_PREFIX", "NoFreeBlocksError", "blocks_for_tokens"]
