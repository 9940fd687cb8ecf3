"""Automatic prefix caching (vLLM's APC) on top of the block manager.

Full blocks are keyed by a chained hash of their tokens (``block_hash.py``); a new request takes
references to the cached blocks that hold the start of its prompt and computes only the rest.
Freed cached blocks stay findable until evicted, least recently used first (``block_pool.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from pagedserve.engine.block_hash import BlockHash, hash_full_blocks, sha256
from pagedserve.engine.block_manager import NO_PREFIX, BlockManager, CachedPrefix

if TYPE_CHECKING:
    from pagedserve.engine.messages import SequenceId


class PrefixCachingBlockManager(BlockManager):
    """A block manager with automatic prefix caching (see the module docstring).

    ``extra`` keys (a cache salt) enter the hash chain with the tokens. ``hash_fn`` can be
    replaced (tests use colliding ones).
    """

    def __init__(self, num_blocks: int, block_size: int, num_cpu_blocks: int = 0,
                 hash_fn: Callable[[bytes], bytes] = sha256) -> None:
        super().__init__(num_blocks, block_size, num_cpu_blocks)
        self._hash_fn = hash_fn
        self._hashes: dict[SequenceId, list[BlockHash]] = {}  # per sequence: hashes of its cached blocks

    def find_cached_prefix(self, token_ids: Sequence[int], extra: bytes = b"",
                           num_prompt_tokens: int | None = None) -> CachedPrefix:
        """The longest cached prefix of ``token_ids`` (the first ``num_prompt_tokens`` the prompt, by default
        all; past it generated tokens, see ``hash_full_blocks``), short of the whole: at least one token
        must be computed to get the next token's logits, so a full hit drops its last block.
        Counted in ``num_queried_tokens`` and ``num_hit_tokens``."""
        hits = self._lookup(token_ids, extra, num_prompt_tokens)
        self.num_queried_tokens += len(token_ids)
        self.num_hit_tokens += len(hits) * self.block_size
        return CachedPrefix(tuple(hits), len(hits) * self.block_size)

    def cached_prefix_length(self, token_ids: Sequence[int], extra: bytes = b"",
                             num_prompt_tokens: int | None = None) -> int:
        """Tokens ``find_cached_prefix`` would hit now (not counted: for placement)."""
        return len(self._lookup(token_ids, extra, num_prompt_tokens)) * self.block_size

    def _lookup(self, token_ids: Sequence[int], extra: bytes, num_prompt_tokens: int | None) -> list:
        hashes = hash_full_blocks(token_ids, self.block_size, extra, self._hash_fn, num_prompt_tokens=num_prompt_tokens)
        hits = self._pool.lookup(hashes)
        return hits[:-1] if len(hits) * self.block_size >= len(token_ids) else hits

    def allocate_slots(self, seq_id: SequenceId, num_tokens: int, prefix: CachedPrefix = NO_PREFIX) -> tuple[int, ...]:
        new_block_ids = super().allocate_slots(seq_id, num_tokens, prefix)
        if prefix.blocks and seq_id not in self._hashes:
            self._hashes[seq_id] = [block.block_hash for block in prefix.blocks]
        return new_block_ids

    def fills_uncached_block(self, seq_id: SequenceId, num_tokens: int) -> bool:
        # "may": cache_full_blocks caches only blocks the request holds (none once swapped out)
        return len(self._hashes.get(seq_id, ())) < num_tokens // self.block_size

    def cache_full_blocks(self, seq_id: SequenceId, token_ids: Callable[[], Sequence[int]], num_tokens: int,
                          extra: bytes = b"", num_prompt_tokens: int | None = None) -> None:
        """Caches the request's blocks that ``num_tokens`` computed (or scheduled) slots fill (the first
        ``num_prompt_tokens`` tokens its prompt, by default all: see ``hash_full_blocks``)."""
        table = self._tables.get(seq_id, [])
        hashes = self._hashes.setdefault(seq_id, [])
        num_full = min(num_tokens // self.block_size, len(table))
        if num_full <= len(hashes):
            return
        tokens = token_ids()
        start = hashes[-1] if hashes else None
        new = hash_full_blocks(tokens[:num_full * self.block_size], self.block_size, extra, self._hash_fn,
                               start=start, first_block=len(hashes), num_prompt_tokens=num_prompt_tokens)
        for index, block_hash in enumerate(new, start=len(hashes)):
            self._pool.cache(table[index], block_hash, table[index - 1] if index else None)
        hashes.extend(new)

    def free(self, seq_id: SequenceId) -> None:
        self._hashes.pop(seq_id, None)
        super().free(seq_id)

    def swap_out(self, seq_id: SequenceId) -> tuple[tuple[int, int], ...]:
        self._hashes.pop(seq_id, None)  # its device blocks are no longer its own
        return super().swap_out(seq_id)
