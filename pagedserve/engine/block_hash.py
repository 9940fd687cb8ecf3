"""Content hashes of full KV blocks, for automatic prefix caching (vLLM's APC).

A full block's hash chains its parent block's hash, its own token ids and extra keys (a cache
salt), so equal hashes mean equal whole prefixes, not just equal blocks. SHA-256 keeps accidental
collisions out of reach; the pool also compares token ids on every hit, so even a colliding hash
function could not hand out a block holding other tokens.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

HashFunction = Callable[[bytes], bytes]


def sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


@dataclass(frozen=True)
class BlockHash:
    """The identity of a full block's content.

    Attributes:
        digest: hash of (parent digest, token ids, extra keys).
        token_ids: the block's own tokens, compared on every cache hit.
    """

    digest: bytes
    token_ids: tuple[int, ...]


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra: bytes = b"",
               hash_fn: HashFunction = sha256, prompt_end: int | None = None) -> BlockHash:
    """The hash of a full block whose predecessor in the sequence hashed to ``parent``. ``prompt_end``: for
    a block holding generated tokens keyed apart (``hash_full_blocks``), its sequence's prompt length; None
    for every other block. The payload's fields cannot run into each other: the parent's digest, the token
    ids (digits and commas), ``extra``'s length then ``extra`` (a client's cache salt: any bytes), and
    ``prompt_end``."""
    tokens = tuple(token_ids)
    payload = b"|".join([parent.digest if parent else b"root", ",".join(map(str, tokens)).encode(),
                         b"%d" % len(extra), extra, b"" if prompt_end is None else b"%d" % prompt_end])
    return BlockHash(hash_fn(payload), tokens)


def hash_full_blocks(token_ids: Sequence[int], block_size: int, extra: bytes = b"",
                     hash_fn: HashFunction = sha256, start: BlockHash | None = None,
                     first_block: int = 0, num_prompt_tokens: int | None = None) -> list[BlockHash]:
    """Hashes of the full blocks of ``token_ids`` from block ``first_block`` on, chained from ``start``.

    With ``num_prompt_tokens`` (``--prefix-cache-outputs own``), a block holding a position at or past it (a
    generated token) has that number among its keys: generated positions' K/V come from the decode attention
    op and a prompt's from the prefill op (``attention_layout``), whose sums differ in their last bits, so
    such a block is found only by a sequence that generated the same tokens after the same prompt (the
    request resumed or recomputed after a preemption), never by a prompt that holds them (a chat's next
    turn), which gets the bits of a fresh prefill. Without it every block is keyed as a prompt's.
    """
    hashes: list[BlockHash] = []
    parent = start
    for begin in range(first_block * block_size, len(token_ids) - block_size + 1, block_size):
        past_prompt = num_prompt_tokens is not None and begin + block_size > num_prompt_tokens
        parent = hash_block(parent, token_ids[begin:begin + block_size], extra, hash_fn,
                            num_prompt_tokens if past_prompt else None)
        hashes.append(parent)
    return hashes
