"""Block manager: the block tables of one worker's sequences, and the only code that changes
reference counts.

PagedAttention (Kwon et al., SOSP 2023, §4.2-4.3): a sequence's KV cache lives in fixed-size
blocks that need not be contiguous; its block table maps logical block i (token positions
``[i * block_size, (i + 1) * block_size)``) to a physical block id. Blocks are allocated as the
sequence grows, so at most ``block_size - 1`` slots per sequence are ever empty.
"""

from __future__ import annotations

from services.scheduler.block_pool import Block, BlockPool, NoFreeBlocksError


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """Number of blocks that hold ``num_tokens`` token slots (ceiling division)."""
    return -(-num_tokens // block_size)


class BlockManager:
    """Allocates and frees the blocks of one worker's KV cache, by request id.

    Args:
        num_blocks: the worker's capacity in blocks.
        block_size: token slots per block.

    Raises:
        ValueError: a non-positive size.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.block_size = block_size
        self._pool = BlockPool(num_blocks)
        self._tables: dict[str, list[Block]] = {}

    @property
    def num_blocks(self) -> int:
        return self._pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self._pool.num_free_blocks

    def num_new_blocks(self, request_id: str, num_tokens: int) -> int:
        """Blocks to add so that the request's table holds ``num_tokens`` slots in all."""
        held = len(self._tables.get(request_id, ()))
        return max(0, blocks_for_tokens(num_tokens, self.block_size) - held)

    def can_allocate(self, request_id: str, num_tokens: int) -> bool:
        """Whether enough blocks are free to grow the request's table to ``num_tokens`` slots."""
        return self.num_new_blocks(request_id, num_tokens) <= self._pool.num_free_blocks

    def allocate_slots(self, request_id: str, num_tokens: int) -> tuple[int, ...]:
        """Grows (or creates) the request's block table to hold ``num_tokens`` slots in all.

        This is both "allocate" for a new sequence and "append slots" for a running one.

        Returns:
            The ids of the blocks added, in table order (empty when the last block had room).

        Raises:
            NoFreeBlocksError: too few free blocks; the table is unchanged.
        """
        return self.allocate_blocks(request_id, self.num_new_blocks(request_id, num_tokens))

    def allocate_blocks(self, request_id: str, count: int) -> tuple[int, ...]:
        """Appends ``count`` free blocks to the request's table (creating it); returns their ids.

        Raises:
            NoFreeBlocksError: fewer than ``count`` blocks are free; the table is unchanged.
        """
        if count > self._pool.num_free_blocks:
            raise NoFreeBlocksError(
                f"request {request_id!r} needs {count} more blocks, {self._pool.num_free_blocks} free"
            )
        new_blocks = self._pool.take(count)
        self._tables.setdefault(request_id, []).extend(new_blocks)
        return tuple(block.block_id for block in new_blocks)

    def free(self, request_id: str) -> None:
        """Drops the request's table and its reference to each block (tail first).

        Unknown ids are ignored, so freeing twice is harmless.
        """
        blocks = self._tables.pop(request_id, None)
        if blocks:
            self._pool.release(blocks[::-1])

    def block_table(self, request_id: str) -> tuple[int, ...]:
        """The request's physical block ids in logical order (empty when it holds none)."""
        return tuple(block.block_id for block in self._tables.get(request_id, ()))

    def ref_count(self, block_id: int) -> int:
        """How many block tables hold ``block_id``."""
        return self._pool.blocks[block_id].ref_count

    def free_block_ids(self) -> list[int]:
        """Free block ids, next to be allocated first (O(n): for tests and debugging)."""
        return self._pool.free_queue.block_ids()

    def request_ids(self) -> list[str]:
        """Requests that hold blocks."""
        return list(self._tables)


__all__ = ["BlockManager", "NoFreeBlocksError", "blocks_for_tokens"]
