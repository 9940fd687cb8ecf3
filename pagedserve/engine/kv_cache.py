"""The paged KV cache: per-layer key and value tensors split into fixed-size blocks.

Layout (shared with ``pagedserve_kernels/`` and the attention backends), per layer and for K and V alike:
``[num_blocks, block_size, num_kv_heads, head_dim]``. A token's slot is
``block_id * block_size + offset_in_block`` (PagedAttention, Kwon et al., SOSP 2023, §4.1-4.2).
Only the worker touches these tensors; the scheduler's block manager decides which blocks a
sequence owns.

The cache's element type may be smaller than the model's (``--kv-cache-dtype``, :func:`cache_dtype`):
K/V are rounded to it when written (:func:`to_cache_dtype`) and widened to the query's dtype or
float32 when read; copies between blocks move bytes, whatever the type.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from dataclasses import dataclass

import torch

from pagedserve.engine.config import KVCacheDtype
from pagedserve.engine.models.huge_pages import HUGE_PAGE_BYTES, HugePageArena, aligned_bytes

CACHE_TORCH_DTYPES = {KVCacheDtype.BFLOAT16: "bfloat16", KVCacheDtype.FP8_E5M2: "float8_e5m2"}
"""The torch dtype (an attribute name of ``torch``) of each ``--kv-cache-dtype`` but ``auto``."""

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
"""An integer type of each element width: what cache copies view the tensors as (CPU torch has no
float8 ``index_copy_``)."""


def cache_dtype(choice: KVCacheDtype | str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's element type for ``--kv-cache-dtype`` ``choice``: ``model_dtype`` for ``auto``.

    Raises:
        ValueError: an unknown choice, or a torch without that dtype (float8_e5m2 came in torch 2.1).
    """
    choice = KVCacheDtype(choice)
    if choice is KVCacheDtype.AUTO:
        return model_dtype
    name = CACHE_TORCH_DTYPES[choice]
    if not isinstance(getattr(torch, name, None), torch.dtype):
        raise ValueError(f"--kv-cache-dtype {choice.value} needs torch.{name}, which torch {torch.__version__} "
                         "does not have: upgrade torch, or use --kv-cache-dtype auto")
    return getattr(torch, name)


def to_cache_dtype(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``rows`` in the cache's element type ``dtype`` (``rows`` itself when it has it): rounded to
    nearest, ties to even (torch's conversion); a float8 type saturates at its largest finite value
    instead of overflowing to inf (as vLLM's fp8 conversions with ``__NV_SATFINITE``)."""
    if rows.dtype == dtype:
        return rows
    if dtype.itemsize == 1:
        largest = torch.finfo(dtype).max
        rows = rows.clamp(-largest, largest)
    return rows.to(dtype)


def as_stored(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``rows`` as a cache of element type ``dtype`` holds them, back in ``rows.dtype``: what attention
    over the new tokens reads, so that a token's K/V are the same numbers whether read from the cache
    or from the step's own tensors."""
    return rows if rows.dtype == dtype else to_cache_dtype(rows, dtype).to(rows.dtype)


def store_rows(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """``cache`` ``[NB, BS, Hkv, D]`` at flat slots ``slots`` int64 ``[T]`` = ``rows`` ``[T, Hkv, D]`` in the
    cache's element type (:func:`to_cache_dtype`), copied as same-width integers."""
    flat = _as_bits(cache).view(-1, cache.shape[2], cache.shape[3])        # (NB*BS, Hkv, D)
    flat.index_copy_(0, slots, _as_bits(to_cache_dtype(rows, cache.dtype)))


def _as_bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s storage viewed as the integer type of its element width."""
    return t.view(_BITS[t.element_size()])


@dataclass(frozen=True)
class KVCacheSpec:
    """Geometry of a paged KV cache.

    Attributes:
        num_layers: transformer layers, each with its own K and V tensors.
        num_kv_heads: key/value heads per layer.
        head_dim: channels per head.
        block_size: token slots per block.
        dtype: element type of the cache (:func:`cache_dtype`).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block takes across all layers, K and V together."""
        element_size = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * element_size


def num_blocks_for_memory(spec: KVCacheSpec, memory_bytes: int, *beside: KVCacheSpec) -> int:
    """How many blocks of ``spec`` fit in ``memory_bytes`` (rounded down), each with a block of every
    cache ``beside`` it (a draft model's, indexed by the same block ids).

    Raises:
        ValueError: not even one block fits.
    """
    block_bytes = spec.bytes_per_block + sum(other.bytes_per_block for other in beside)
    num_blocks = memory_bytes // block_bytes
    if num_blocks < 1:
        layers = " + ".join(str(s.num_layers) for s in (spec, *beside))
        raise ValueError(
            f"a KV-cache budget of {memory_bytes} bytes holds no block: one block of {spec.block_size} "
            f"tokens takes {block_bytes} bytes over {layers} layers"
        )
    return num_blocks


def context_shortfall(spec: KVCacheSpec, num_blocks: int, max_model_len: int, *beside: KVCacheSpec,
                      num_caches: int = 1) -> str | None:
    """What to tell the operator when ``num_blocks`` blocks (each with a block of every cache ``beside`` it)
    hold fewer token slots than one context of ``max_model_len`` tokens: a request that grows past them,
    even alone on the worker, ends with finish reason ``length`` before its ``max_tokens`` (vLLM refuses to
    start instead). ``num_caches``: caches of this size sharing the ``--kv-cache-memory`` (a pipeline-parallel
    worker's virtual engines). None when a whole context fits."""
    slots = num_blocks * spec.block_size
    if slots >= max_model_len:
        return None
    block_bytes = spec.bytes_per_block + sum(s.bytes_per_block for s in beside)
    needed = -(-max_model_len // spec.block_size) * block_bytes * num_caches
    return (f"the KV cache holds {slots} tokens ({num_blocks} blocks of {spec.block_size}), fewer than the model's "
            f"context of {max_model_len}: a request that grows past {slots} tokens ends with finish_reason "
            f"'length'; give --kv-cache-memory {-(-needed // (1 << 20))}MiB or more to hold a whole context")


def num_cpu_blocks_for_memory(spec: KVCacheSpec, swap_space_bytes: int, *beside: KVCacheSpec) -> int:
    """How many swap blocks of ``spec`` fit in ``swap_space_bytes`` (0 is allowed: no swapping), each
    with a block of every cache ``beside`` it (as :func:`num_blocks_for_memory`)."""
    return swap_space_bytes // sum(s.bytes_per_block for s in (spec, *beside))


class KVCache:
    """Per-layer K and V tensors, each ``[num_blocks, block_size, num_kv_heads, head_dim]``.

    The tensors start zeroed so that padded reads of unused slots stay finite (attention masks
    them, and a NaN there would still poison ``0 * NaN``). On the CPU, a cache of 2 MiB or more keeps
    its layers in one mapping of 2 MiB pages (views of one storage: clone a layer before saving it).

    Swap space (for swap preemption) is a second set of the same tensors with ``num_cpu_blocks``
    blocks in CPU memory; the scheduler's plans say which blocks to copy out and back.

    Args:
        spec: the cache geometry.
        num_blocks: physical blocks per layer (>= 1).
        device: where the tensors live.
        num_cpu_blocks: swap blocks in CPU memory (0: none).

    Raises:
        ValueError: ``num_blocks < 1``.
    """

    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device | str = "cpu",
                 num_cpu_blocks: int = 0) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.spec = spec
        self.num_blocks = num_blocks
        self.num_cpu_blocks = num_cpu_blocks
        shape = (num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        zeros = _zeros_maker(shape, spec.dtype, device, count=2 * spec.num_layers)
        self.key_caches = [zeros() for _ in range(spec.num_layers)]
        self.value_caches = [zeros() for _ in range(spec.num_layers)]
        cpu_shape = (num_cpu_blocks, *shape[1:])
        self.cpu_key_caches = [torch.zeros(cpu_shape, dtype=spec.dtype) for _ in range(spec.num_layers if num_cpu_blocks else 0)]
        self.cpu_value_caches = [torch.zeros(cpu_shape, dtype=spec.dtype) for _ in range(spec.num_layers if num_cpu_blocks else 0)]

    def move_blocks(self, swap_out: Sequence[tuple[int, int]], swap_in: Sequence[tuple[int, int]],
                    copy: Sequence[tuple[int, int]]) -> None:
        """A plan's block moves in its order: :meth:`swap_out`, :meth:`swap_in`, then :meth:`copy_blocks`."""
        self.swap_out(swap_out)
        self.swap_in(swap_in)
        self.copy_blocks(copy)

    def swap_out(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copies device blocks to CPU blocks: ``(device block, cpu block)`` pairs, every layer."""
        _copy_pairs(self.key_caches, self.cpu_key_caches, pairs)
        _copy_pairs(self.value_caches, self.cpu_value_caches, pairs)

    def swap_in(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copies CPU blocks to device blocks: ``(cpu block, device block)`` pairs, every layer."""
        _copy_pairs(self.cpu_key_caches, self.key_caches, pairs)
        _copy_pairs(self.cpu_value_caches, self.value_caches, pairs)

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copies device blocks to device blocks (copy-on-write): ``(source, destination)`` pairs."""
        _copy_pairs(self.key_caches, self.key_caches, pairs)
        _copy_pairs(self.value_caches, self.value_caches, pairs)

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``(key_cache, value_cache)`` pair of layer ``index``, each ``[NB, BS, Hkv, D]``."""
        return self.key_caches[index], self.value_caches[index]


def _zeros_maker(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str,
                 count: int) -> Callable[[], torch.Tensor]:
    """Makes ``count`` zeroed ``shape`` tensors of ``dtype`` on ``device``; on the CPU, when they take at least
    a huge page together, from one mapping of 2 MiB pages where Linux gives them (``HugePageArena``): decode
    attention reads each sequence's blocks scattered over the cache, a TLB miss every 4 KiB on ordinary
    pages (the attention op's figures: docs/benchmarks.md, the changes table)."""
    layer_bytes = aligned_bytes(math.prod(shape) * dtype.itemsize)
    if torch.device(device).type != "cpu" or count * layer_bytes < HUGE_PAGE_BYTES:
        return lambda: torch.zeros(shape, dtype=dtype, device=device)
    arena = HugePageArena(chunk_bytes=count * layer_bytes)
    return lambda: arena.empty(shape, dtype).zero_()


def _copy_pairs(sources: list[torch.Tensor], targets: list[torch.Tensor], pairs: Sequence[tuple[int, int]]) -> None:
    """``targets[l][dst] = sources[l][src]`` for every layer ``l`` and pair; sources are read first.
    Bytes are copied (same-width integer views), so every cache dtype copies exactly."""
    if not pairs:
        return
    src = torch.tensor([p[0] for p in pairs], dtype=torch.int64)
    dst = torch.tensor([p[1] for p in pairs], dtype=torch.int64)
    for source, target in zip(sources, targets):
        rows = _as_bits(source).index_select(0, src.to(source.device))  # (P, BS, Hkv, D)
        _as_bits(target).index_copy_(0, dst.to(target.device), rows.to(target.device))


def sized_cache(spec: KVCacheSpec, memory_bytes: int, swap_space_bytes: int, device: torch.device | str,
                *beside: KVCacheSpec) -> KVCache:
    """A cache of ``spec`` with as many blocks as fit in ``memory_bytes`` (and swap blocks in
    ``swap_space_bytes``), each with a block of every cache ``beside`` it (a draft model's: the
    same block ids index both, so both have these counts).

    Raises:
        ValueError: not even one block fits (:func:`num_blocks_for_memory`).
    """
    return KVCache(spec, num_blocks_for_memory(spec, memory_bytes, *beside), device=device,
                   num_cpu_blocks=num_cpu_blocks_for_memory(spec, swap_space_bytes, *beside))
