"""`pagedserve bench attention-op`: the CPU decode attention op's memory bandwidth per KV-cache dtype.

Decode attention reads every cached K and V element once per step, so it is bound by memory: its
figure of merit is GB/s = bytes of K/V read / time. Each KV dtype (--kv-cache-dtype: the model's own
(--dtype), bfloat16, fp8_e5m2) runs the compiled op (``attention/csrc``) on the same decode batch
(a ShareGPT-like shape by default: 64 sequences of ~500 context tokens, the default model's 9 query
and 3 KV heads of 64, shuffled block tables), over ``--layers`` caches in turn so that the K/V come
from DRAM as in the model, not from the last-level cache; the caches are allocated as a worker's are
(``KVCache``: 2 MiB pages where Linux gives them). Beside them, in the same run and rounds, the streaming
read (``streaming_read``: ``torch.sum`` over 512 MiB on 2 MiB pages, as the caches; the share is of it) and
the same read on 4 KiB pages (the yardstick before 2026-12-07, for comparison with older figures). Each
round times the reads and every KV dtype in turn; the figures are medians of ``--rounds`` rounds.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from pagedserve.bench.machine import machine_info, machine_line
from pagedserve.bench.report import format_table
from pagedserve.bench.streaming_read import STREAM_BYTES, Pages, read_buffer
from pagedserve.engine.config import KVCacheDtype


@dataclass(frozen=True)
class OpTiming:
    """One KV dtype's decode attention over one layer's cache.

    Attributes:
        kv_cache_dtype: the flag's value; ``cache_dtype`` the torch dtype it stored.
        ms: median time of one call (one layer of the batch), milliseconds.
        kv_bytes: K and V bytes one call reads.
        gbps: ``kv_bytes / ms``, 10^9 bytes per second.
        stream_share: ``gbps`` over the streaming read's GB/s (on 2 MiB pages, as the caches).
    """

    kv_cache_dtype: str
    cache_dtype: str
    ms: float
    kv_bytes: int
    gbps: float
    stream_share: float


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("attention-op", help="the CPU decode attention op's GB/s per KV-cache dtype vs a streaming read",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-seqs", type=int, default=64, help="decoding sequences (default %(default)s)")
    p.add_argument("--context-len", type=int, default=500,
                   help="mean context tokens, each sequence's drawn uniformly within +-25%% (default %(default)s)")
    p.add_argument("--num-heads", type=int, default=9, help="query heads (default %(default)s)")
    p.add_argument("--num-kv-heads", type=int, default=3, help="KV heads (default %(default)s)")
    p.add_argument("--head-dim", type=int, default=64, help="channels per head (default %(default)s)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default %(default)s)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="the model's dtype: the query's, and the cache's under --kv-cache-dtype auto (default "
                        "%(default)s)")
    p.add_argument("--layers", type=int, default=8,
                   help="caches called in turn, one per layer; every KV dtype's are held at once (with a float32 model "
                        "1.75x its own caches' memory, with bfloat16 1.25x) (default %(default)s)")
    p.add_argument("--rounds", type=int, default=7, help="timed rounds, each over every layer (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of lengths, tables and values (default %(default)s)")
    p.add_argument("--result-json", type=Path, help="write every figure here")
    p.set_defaults(func=run)


def _decode_batch(args: argparse.Namespace):
    """Metadata of ``num_seqs`` decodes with ragged contexts in shuffled blocks, and the block count."""
    from pagedserve.engine.attention import build_attention_metadata, compute_positions

    rng = random.Random(args.seed)
    contexts = [rng.randint(args.context_len * 3 // 4, args.context_len * 5 // 4) for _ in range(args.num_seqs)]
    blocks = [-(-(c + 1) // args.block_size) for c in contexts]
    free = list(range(sum(blocks)))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(n)] for n in blocks]
    ones = [1] * args.num_seqs
    return build_attention_metadata(ones, contexts, tables, compute_positions(ones, contexts), args.block_size), \
        sum(blocks)


def _mean_ms(call, repeats: int) -> float:
    """The mean time of ``repeats`` calls ``call(0) .. call(repeats - 1)``, milliseconds."""
    start = time.perf_counter()
    for i in range(repeats):
        call(i)
    return (time.perf_counter() - start) / repeats * 1e3


def median_ms(call, repeats: int, rounds: int) -> float:
    """Median over ``rounds`` of the mean time of ``repeats`` calls, milliseconds (one warm-up round)."""
    return interleaved_median_ms([(call, repeats)], rounds)[0]


def interleaved_median_ms(calls: list[tuple], rounds: int) -> list[float]:
    """Each ``(call, repeats)``'s median over ``rounds`` rounds, every round timing each in turn (milliseconds).

    Timing the calls in turns within each round, not one after the other, gives each the same drift of the
    machine (this VM's streaming read moved 29-47 GB/s between runs). One warm-up round is not counted.
    """
    times: list[list[float]] = [[] for _ in calls]
    for _ in range(rounds + 1):
        for t, (call, repeats) in zip(times, calls):
            t.append(_mean_ms(call, repeats))
    return [statistics.median(t[1:]) for t in times]


def _layer_caller(op, md, query, out, caches, head_dim: int):
    """``call(i)``: the op over layer ``i % len(caches)``'s K/V."""
    def call(i: int) -> None:
        k, v = caches[i % len(caches)]
        op(out, query, k, v, md.block_tables, md.seq_lens, md.query_start_loc, head_dim ** -0.5)
    return call


def measure(args: argparse.Namespace) -> tuple[dict[Pages, float], list[OpTiming]]:
    """The streaming read's GB/s on each kind of :class:`Pages` and each KV dtype's :class:`OpTiming`, timed in
    turns within each round.

    Raises:
        RuntimeError: the C++ op cannot be built here.
    """
    import torch

    from pagedserve.engine.attention.cpu_op import load_cpu_attention_op
    from pagedserve.engine.kv_cache import KVCache, KVCacheSpec, cache_dtype, to_cache_dtype

    op = load_cpu_attention_op()
    if op is None:
        raise RuntimeError("the C++ attention op could not be built here (see the warning above)")
    md, num_blocks = _decode_batch(args)
    g = torch.Generator().manual_seed(args.seed)
    model_dtype = getattr(torch, args.dtype)
    query = torch.randn(args.num_seqs, args.num_heads, args.head_dim, generator=g).to(model_dtype)  # (S, H, D)
    out = torch.empty_like(query)
    shape = (num_blocks, args.block_size, args.num_kv_heads, args.head_dim)
    buffers = [read_buffer(pages) for pages in Pages]
    calls, dtypes = [(lambda i, b=b: b.sum(), 5) for b in buffers], []
    for choice in KVCacheDtype:
        dtype = cache_dtype(choice, model_dtype)
        kv_cache = KVCache(KVCacheSpec(args.layers, args.num_kv_heads, args.head_dim, args.block_size, dtype),
                           num_blocks)  # the worker's memory (2 MiB pages where Linux gives them)
        for layer in kv_cache.key_caches + kv_cache.value_caches:
            layer.copy_(to_cache_dtype(torch.randn(shape, generator=g), dtype))
        caches = [kv_cache.layer(i) for i in range(args.layers)]
        calls.append((_layer_caller(op, md, query, out, caches, args.head_dim), 4 * args.layers))
        dtypes.append((choice, dtype))
    medians = interleaved_median_ms(calls, args.rounds)
    streams = {pages: STREAM_BYTES / ms / 1e6 for pages, ms in zip(Pages, medians)}
    op_ms, stream_gbps = medians[len(Pages):], streams[Pages.HUGE]
    timings = []
    for (choice, dtype), ms in zip(dtypes, op_ms):
        kv_bytes = 2 * int(md.seq_lens.sum()) * args.num_kv_heads * args.head_dim * dtype.itemsize
        timings.append(OpTiming(choice.value, str(dtype).removeprefix("torch."), ms, kv_bytes, kv_bytes / ms / 1e6,
                                kv_bytes / ms / 1e6 / stream_gbps))
    return streams, timings


def run(args: argparse.Namespace) -> int:
    import torch

    streams, timings = measure(args)
    title = (f"decode attention op, {args.dtype} query, {args.num_seqs} seqs x ~{args.context_len} tokens, H{args.num_heads}/"
             f"{args.num_kv_heads} D{args.head_dim} bs{args.block_size}, {torch.get_num_threads()} threads")
    rows = [(t.kv_cache_dtype, t.cache_dtype, t.ms, t.kv_bytes / 1e6, t.gbps, 100 * t.stream_share,
             timings[0].ms / t.ms) for t in timings]
    rows += [(f"streaming read, {pages.value}", "float32 sum", STREAM_BYTES / gbps / 1e6, STREAM_BYTES / 1e6, gbps,
              100 * gbps / streams[Pages.HUGE], None) for pages, gbps in streams.items()]
    print(format_table(("--kv-cache-dtype", "stored as", "ms/layer", "MB read", "GB/s", "% of stream",
                        "x auto's speed"), rows, title))
    info = machine_info()
    print(machine_line(info))
    if args.result_json:
        args.result_json.write_text(json.dumps({"stream_gbps": streams[Pages.HUGE],
                                                "stream_gbps_4k_pages": streams[Pages.SMALL],
                                                "ops": [asdict(t) for t in timings],
                                                "settings": {k: str(v) for k, v in vars(args).items() if k != "func"},
                                                "threads": torch.get_num_threads(), "machine": info}, indent=2) + "\n")
    return 0
