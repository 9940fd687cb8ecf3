"""Physical KV-cache blocks and their free list.

The free list is a doubly linked list threaded through the blocks themselves (as in vLLM V1's
block pool), so taking the head, appending at the tail and unlinking a block from the middle are
all O(1). Freed blocks go to the tail, so the head is always the least recently freed block.

With prefix caching, a full block keeps its content hash after it is freed: it stays findable
until it is taken again from the head of the free list (evicted, least recently used first).
"""

from __future__ import annotations

from pagedserve.engine.block_hash import BlockHash


class NoFreeBlocksError(RuntimeError):
    """More blocks were asked for than are free. Callers check ``num_free_blocks`` first."""


class Block:
    """One physical block: ``block_size`` token slots of K and V in every layer of one worker.

    Attributes:
        block_id: index into the worker's KV-cache tensors, ``0 <= block_id < num_blocks``.
        ref_count: how many block tables hold this block (0 when free).
        block_hash: its content hash once it is full and cached; cleared when it is evicted.
        parent, parent_generation: the block that held the previous tokens when this one was
            cached, and that block's generation then (a hit must follow the same chain of blocks).
        generation: how often this block has been evicted (its content replaced).
        prev_free, next_free: neighbours in the free list; ``None`` when not linked.
    """

    __slots__ = ("block_id", "ref_count", "block_hash", "parent", "parent_generation", "generation",
                 "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: BlockHash | None = None
        self.parent: Block | None = None
        self.parent_generation = 0
        self.generation = 0
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
    """All physical blocks of one worker: reference counts, the free list, the prefix cache.

    Args:
        num_blocks: the worker's capacity in blocks, ``>= 1``.

    Raises:
        ValueError: ``num_blocks < 1``.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self._cached: dict[bytes, Block] = {}  # digest -> the block holding that content
        self.num_evictions = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks no table holds (cached ones included: they are evicted when taken)."""
        return len(self.free_queue)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def cached_digests(self) -> list[bytes]:
        """The content hashes (``BlockHash.digest``) of every cached block, in no order."""
        return list(self._cached)

    def take(self, count: int) -> list[Block]:
        """Takes ``count`` free blocks (least recently freed first), each with ``ref_count`` 1.

        A taken block that was cached is evicted: its hash is forgotten.

        Raises:
            NoFreeBlocksError: fewer than ``count`` blocks are free; nothing is taken.
        """
        if count > len(self.free_queue):
            raise NoFreeBlocksError(f"asked for {count} blocks, {len(self.free_queue)} free")
        taken = [self.free_queue.popleft() for _ in range(count)]
        for block in taken:
            if block.block_hash is not None:
                self._evict(block)
            block.ref_count = 1
        return taken

    def touch(self, blocks: list[Block]) -> None:
        """Takes one more reference to each block (a cache hit, or a fork); free ones leave the free list."""
        for block in blocks:
            if block.ref_count == 0:
                self.free_queue.remove(block)
            block.ref_count += 1

    def release(self, blocks: list[Block]) -> None:
        """Drops one reference to each block; blocks that reach 0 go to the back of the free list
        (and stay cached if they have a hash).

        Pass a sequence's blocks tail first, so that its last blocks are evicted first.

        Raises:
            ValueError: a block that is already free.
        """
        for block in blocks:
            if block.ref_count <= 0:
                raise ValueError(f"{block} is already free")
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue.append(block)

    def cache(self, block: Block, block_hash: BlockHash, parent: Block | None) -> None:
        """Records that a held, full ``block`` holds ``block_hash``'s content, computed after ``parent``.

        A block keeps its first hash; content already cached in another block is not cached twice.
        """
        if block.block_hash is None and block_hash.digest not in self._cached:
            block.block_hash = block_hash
            block.parent = parent
            block.parent_generation = parent.generation if parent is not None else 0
            self._cached[block_hash.digest] = block

    def lookup(self, hashes: list[BlockHash]) -> list[Block]:
        """The cached blocks of the longest prefix of ``hashes``.

        Every hit is checked beyond its hash: same token ids, and cached right after the previous
        hit (same block, same generation), so a hash collision can shorten a hit but never return
        a block computed for other tokens.
        """
        hits: list[Block] = []
        for block_hash in hashes:
            block = self._cached.get(block_hash.digest)
            parent = hits[-1] if hits else None
            if (block is None or block.block_hash != block_hash or block.parent is not parent
                    or (parent is not None and block.parent_generation != parent.generation)):
                break
            hits.append(block)
        return hits

    def _evict(self, block: Block) -> None:
        assert block.block_hash is not None
        if self._cached.get(block.block_hash.digest) is block:
            del self._cached[block.block_hash.digest]
        block.block_hash = None
        block.parent = None
        block.generation += 1
        self.num_evictions += 1
