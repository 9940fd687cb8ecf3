"""The streaming read that the memory-bound kernels' GB/s are compared with (`bench attention-op`, `bench
gemm-rows`): ``torch.sum`` over a 512 MiB float32 buffer, on the pages the kernels read from.

The KV cache and the packed GEMM weights live on 2 MiB pages (``models.huge_pages.HugePageArena``), so the
read that measures what the memory gives them must too: on 4 KiB pages the hardware prefetchers stop at
every page's end and the TLB misses every 4 KiB, and the same sum reads less. On the Zen 4 EPYC of
2026-12-07 the read on 4 KiB pages gave 40.5 GB/s where on 2 MiB pages it gave 59.7 (median of 10
alternated calls, 2 threads; 21.5 and 31.2 on one thread): until that day both benches compared with
the 4 KiB read, which flattered every "% of the streaming read" (docs/benchmarks.md, "The streaming
read on the kernels' pages").
"""

from __future__ import annotations

import enum

STREAM_BYTES = 512 << 20


class Pages(enum.Enum):
    """Which pages a streaming-read buffer is on."""

    HUGE = "2 MiB pages"  # as the KV cache and the packed weights: the yardstick
    SMALL = "4 KiB pages"  # torch's own allocation: the benches' yardstick before 2026-12-07


def read_buffer(pages: Pages):
    """A float32 [STREAM_BYTES / 4] tensor of ones on ``pages`` (on Linux without THP, 4 KiB pages either way)."""
    import torch

    from pagedserve.engine.models.huge_pages import HugePageArena

    if pages is Pages.SMALL:
        return torch.ones(STREAM_BYTES // 4)
    return HugePageArena(chunk_bytes=STREAM_BYTES).empty((STREAM_BYTES // 4,), torch.float32).fill_(1.0)
