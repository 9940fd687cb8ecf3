"""Physical KV-cache blocks and their free list.

The free list is a doubly linked list threaded through the blocks themselves (as in vLLM V1's
block pool), so taking the head, appending at the tail and unlinking a block from the middle are
all O(1). Freed blocks go to the tail, so the head is always the least recently freed block: the
order an LRU eviction of cached blocks will need.
"""

from __future__ import annotations


class NoFreeBlocksError(RuntimeError):
    """More blocks were asked for than are free. Callers check ``num_free_blocks`` first."""


class Block:
    """One physical block: ``block_size`` token slots of K and V in every layer of one worker.

    Attributes:
        block_id: index into the worker's KV-cache tensors, ``0 <= block_id < num_blocks``.
        ref_count: how many block tables hold this block (0 when free).
        prev_free, next_free: neighbours in the free list; ``None`` when not linked.
    """

    __slots__ = ("block_id", "ref_count", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.prev_free: Block | None = None
        self.next_free: Block | None = None

    def __repr__(self) -> str:
        return f"Block(id={self.block_id}, ref_count={self.ref_count})"


class FreeBlockQueue:
    """Doubly linked list of free blocks, oldest-freed first, with O(1) pop, push and remove."""

    def __init__(self, blocks: list[Block]) -> None:
        self._head: Block | None = None  # least recently freed
        self._tail: Block | None = None  # most recently freed
        self._length = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._length

    def __contains__(self, block: Block) -> bool:
        return block.prev_free is not None or block.next_free is not None or self._head is block

    def append(self, block: Block) -> None:
        """Links ``block`` at the tail (most recently freed)."""
        block.prev_free, block.next_free = self._tail, None
        if self._tail is None:
            self._head = block
        else:
            self._tail.next_free = block
        self._tail = block
        self._length += 1

    def remove(self, block: Block) -> None:
        """Unlinks ``block`` from wherever it is in the list.

        Raises:
            ValueError: the block is not in the list.
        """
        if block not in self:
            raise ValueError(f"{block} is not in the free list")
        prev, nxt = block.prev_free, block.next_free
        if prev is None:
            self._head = nxt
        else:
            prev.next_free = nxt
        if nxt is None:
            self._tail = prev
        else:
            nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self._length -= 1

    def popleft(self) -> Block:
        """Unlinks and returns the least recently freed block.

        Raises:
            NoFreeBlocksError: the list is empty.
        """
        if self._head is None:
            raise NoFreeBlocksError("no free blocks")
        block = self._head
        self.remove(block)
        return block

    def block_ids(self) -> list[int]:
        """The free block ids in list order (for tests and stats; O(n))."""
        ids, node = [], self._head
        while node is not None:
            ids.append(node.block_id)
            node = node.next_free
        return ids


class BlockPool:
    """All physical blocks of one worker, with reference counts and the free list.

    Args:
        num_blocks: the worker's KV capacity in blocks, ``>= 1``.

    Raises:
        ValueError: ``num_blocks < 1``.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def take(self, count: int) -> list[Block]:
        """Takes ``count`` free blocks (oldest freed first), each with ``ref_count`` 1.

        Raises:
            NoFreeBlocksError: fewer than ``count`` blocks are free; nothing is taken.
        """
        if count > len(self.free_queue):
            raise NoFreeBlocksError(f"asked for {count} blocks, {len(self.free_queue)} free")
        taken = [self.free_queue.popleft() for _ in range(count)]
        for block in taken:
            block.ref_count = 1
        return taken

    def release(self, blocks: list[Block]) -> None:
        """Drops one reference to each block; blocks that reach 0 go to the back of the free list.

        Pass a sequence's blocks tail first, so that its last blocks are reused first.

        Raises:
            ValueError: a block that is already free.
        """
        for block in blocks:
            if block.ref_count <= 0:
                raise ValueError(f"{block} is already free")
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue.append(block)
