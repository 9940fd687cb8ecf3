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
               hash_fn: HashFunction = sha256) -> BlockHash:
    """The hash of a full block whose predecessor in the sequence hashed to ``parent``."""
    tokens = tuple(token_ids)
    payload = (parent.digest if parent else b"root") + b"|" + ",".join(map(str, tokens)).encode() + b"|" + extra
    return BlockHash(hash_fn(payload), tokens)


def hash_full_blocks(token_ids: Sequence[int], block_size: int, extra: bytes = b"",
                     hash_fn: HashFunction = sha256, start: BlockHash | None = None,
                     first_block: int = 0, num_prompt_tokens: int | None = None) -> list[BlockHash]:
    """Hashes of the full blocks of ``token_ids`` from block ``first_block`` on, chained from ``start``.

    A block holding a position at or past ``num_prompt_tokens`` (a generated token; by default every token is
    the prompt's) has that number among its keys: generated positions' K/V come from the decode attention op
    and a prompt's from the prefill op (``attention_layout``), whose sums differ in their last bits, so such
    a block is found only by a sequence that generated the same tokens after the same prompt (the request
    resumed or recomputed after a preemption), never by a prompt that holds them (a chat's next turn), which
    would otherwise get other logprobs from a hit than from a fresh prefill.
    """
    hashes: list[BlockHash] = []
    parent = start
    prompt_end = len(token_ids) if num_prompt_tokens is None else num_prompt_tokens
    generated = extra + b"|generated from %d" % prompt_end
    for begin in range(first_block * block_size, len(token_ids) - block_size + 1, block_size):
        keys = generated if begin + block_size > prompt_end else extra
        parent = hash_block(parent, token_ids[begin:begin + block_size], keys, hash_fn)
        hashes.append(parent)
    return hashes
