"""Tensors on 2 MiB pages: a bump allocator over anonymous mappings marked ``MADV_HUGEPAGE``, for the packed
GEMM weights and a CPU worker's KV cache.

A decode step of a few sequences reads every GEMM weight once from DRAM, so its GEMMs run at the
memory's speed, and on 4 KiB pages they lose part of it: a TLB miss every 4 KiB, and the hardware
prefetchers stop at each 4 KiB page's end. The panel GEMM over the default model's weights at one
row runs faster from 2 MiB pages (the figures: docs/benchmarks.md, "Packed weights on 2 MiB pages"),
and so does decode attention over blocks scattered in the KV cache (``kv_cache.KVCache``).

Linux's transparent huge pages (THP) give 2 MiB pages to a range marked ``MADV_HUGEPAGE`` when its
pages are first touched, in THP's ``madvise`` mode (the usual default) and in ``always`` mode; in
``never`` mode, or off Linux, the arena is ordinary memory and everything works the same, slower.

The arena maps chunks of ``chunk_bytes`` (or one tensor's size, if larger) at a 2 MiB boundary and
hands out 64-byte-aligned tensors in order. Only the pages written are backed by memory, so a chunk's
unused tail costs address space, not RAM. A chunk is unmapped when the last tensor viewing it is freed
(``torch.frombuffer`` holds a reference to the mapping): the tensors of one chunk are views of one
storage, so one of them saved (``torch.save``) or sent to another process takes the whole chunk along;
clone it first.
"""

from __future__ import annotations

import math
import mmap

import torch

HUGE_PAGE_BYTES = 2 << 20
CHUNK_BYTES = 64 << 20
"""Bytes an arena maps at a time by default: 32 huge pages, ~12% of the default model's float32 panels."""
ALIGN_BYTES = 64
"""Each tensor starts on a cache line."""


class HugePageArena:
    """Allocates tensors, in order, from chunks of memory marked for 2 MiB pages.

    One arena per model build (:func:`~pagedserve.engine.models.onednn.pack_linear_layers` makes one) and per
    CPU KV cache; not thread-safe. Tensors are uninitialized, like ``torch.empty``'s: write them before reading.

    Args:
        chunk_bytes: bytes mapped at a time (rounded up to 2 MiB): the most address space a small
            arena takes.
    """

    def __init__(self, chunk_bytes: int = CHUNK_BYTES) -> None:
        self._chunk: torch.Tensor | None = None  # uint8 [bytes] over the current mapping, 2 MiB aligned
        self._used = 0
        self._chunk_bytes = chunk_bytes

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized contiguous ``shape`` tensor of ``dtype`` on the CPU, 64-byte aligned."""
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        if self._chunk is None or self._used + nbytes > self._chunk.numel():
            self._chunk, self._used = _map_chunk(max(self._chunk_bytes, nbytes)), 0
        tensor = self._chunk[self._used:self._used + nbytes].view(dtype).view(shape)
        self._used += aligned_bytes(nbytes)
        return tensor


def aligned_bytes(nbytes: int) -> int:
    """The bytes a tensor of ``nbytes`` takes in an arena: rounded up to :data:`ALIGN_BYTES`."""
    return -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES


def _map_chunk(nbytes: int) -> torch.Tensor:
    """A uint8 tensor over a fresh private anonymous mapping of at least ``nbytes``, starting at a 2 MiB
    boundary and marked ``MADV_HUGEPAGE`` where the platform has it."""
    size = -(-nbytes // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    mapping = mmap.mmap(-1, size + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        mapping.madvise(advice)  # before the first touch: the page faults then take 2 MiB pages
    whole = torch.frombuffer(mapping, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE_BYTES
    return whole[start:start + size]
