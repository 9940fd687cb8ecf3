"""Peak memory of one tensor-parallel rank while it loads its shard (issue #12).

Run one rank per fresh process: ``python -m tests.worker.load_memory FOLDER RANK WORLD_SIZE [DTYPE]``
(or, ``--each-rank WORLD_SIZE FOLDER...``, every rank of every folder one after another in one fresh
process, each model freed before the next is measured) prints one JSON line per rank (bytes):
``peak`` (the most tensor memory live at once while building and filling the shard), ``shard``
(the loaded model's parameters and buffers), ``largest_slice`` (the
largest checkpoint slice this rank reads, in the model's dtype) and ``largest_tensor`` (the largest
whole checkpoint tensor, in the model's dtype).

What "peak" measures, and why: every tensor allocation and free of torch's CPU allocator, recorded
by ``torch.profiler`` (``profile_memory=True``) with the allocator's running total, from before
the model is built until it is loaded; ``peak`` is the highest total. The RSS high-water mark
(``VmHWM``) is not usable here: ``safetensors`` maps the checkpoint and hands out zero-copy views
of it, so every page a rank touches (for a column slice, every row of the whole tensor) counts in
its RSS as file-backed page cache, which the kernel can drop at any time and which the ranks share.
The allocator total counts exactly what a rank owns: the parameters it holds, plus whatever the
loader copies, converts or pads along the way.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LoadOnlyRank:
    """Rank ``rank`` of ``world_size`` as the model needs it to build its shard (no collective
    runs while loading, so no process group is joined)."""

    rank: int
    world_size: int


def _walk(nodes):
    for node in nodes:
        yield node
        yield from _walk(node.children)


def _peak_allocated(prof) -> int:
    """The highest running total of the CPU allocator over a finished profile (bytes)."""
    from torch._C._profiler import _EventType

    events = sorted((e for e in _walk(prof.profiler.kineto_results.experimental_event_tree())
                     if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu"),
                    key=lambda e: e.start_time_ns)
    if not events:
        return 0
    base = events[0].extra_fields.total_allocated - events[0].extra_fields.alloc_size
    return max(e.extra_fields.total_allocated for e in events) - base


def measure_rank_load(folder: str, rank: int, world_size: int, dtype: torch.dtype = torch.float32) -> dict:
    """Loads rank ``rank``'s shard of ``folder`` (as ``load_model_shard`` does in a worker) under the
    profiler; returns the figures described in the module docstring."""
    from torch.profiler import ProfilerActivity, profile

    from pagedserve.engine.parallel.rank import load_model_shard
    from pagedserve.engine.parallel.sharding import iter_sharded_checkpoint
    from pagedserve.engine.weight_loader import iter_checkpoint

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model = load_model_shard(folder, LoadOnlyRank(rank, world_size), dtype, "cpu")
    owned = {t.data_ptr(): t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers())}
    item = dtype.itemsize
    slices = [t.numel() * item for _, t in iter_sharded_checkpoint(folder, model.checkpoint_slice)]
    whole = [t.numel() * item for _, t in iter_checkpoint(folder)]
    return {"rank": rank, "world_size": world_size, "peak": _peak_allocated(prof), "shard": sum(owned.values()),
            "largest_slice": max(slices), "largest_tensor": max(whole)}


if __name__ == "__main__":
    if sys.argv[1] == "--each-rank":
        world = int(sys.argv[2])
        for folder in sys.argv[3:]:
            for rank in range(world):
                print(json.dumps({"folder": folder, **measure_rank_load(folder, rank, world)}), flush=True)
        sys.exit(0)
    folder, rank, world = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    dtype = getattr(torch, sys.argv[4]) if len(sys.argv) > 4 else torch.float32
    print(json.dumps(measure_rank_load(folder, rank, world, dtype)))
