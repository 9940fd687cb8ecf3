"""Issue #23's check of the CPU attention op against vLLM's, in one process, alternating rounds.

Runs under vLLM's interpreter (it imports vLLM's ops and loads pagedserve's built op library by path,
so both share one torch; the two venvs must have the same torch version):

    SO=$(ls -t ~/.cache/pagedserve/ops/pagedserve_cpu_attention_*/*.so | head -1)
    $VLLM_PYTHON scripts/attention_vs_vllm.py "$SO"

The decode batch is `pagedserve bench attention-op`'s default shape: 64 sequences of 375-625 context
tokens, 9 query and 3 KV heads of 64, shuffled block tables; six caches in turn. vLLM's op gets its
own layout (block 128, [blocks, KV heads, 2 x 128, 64]) and the ISA vLLM picks (float32: vec;
bfloat16: amx where the CPU has it); pagedserve's its [blocks, 16, KV heads, 64]. Prints each op's
median time per call (one layer) and GB/s of K/V read. A measurement, not a test.
"""

from __future__ import annotations

import os
import random
import statistics
import sys
import time

os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")

import torch  # noqa: E402
import vllm._C  # noqa: E402,F401  (registers torch.ops._C)
import vllm._custom_ops as ops  # noqa: E402

SEQS, HEADS, KV_HEADS, HEAD_DIM, CACHES, ROUNDS = 64, 9, 3, 64, 6, 10


def block_table(lens: list[int], block_size: int, rng: random.Random) -> tuple[torch.Tensor, int]:
    """A shuffled block table ``int32 [SEQS, max blocks]`` and the block count."""
    blocks = [-(-n // block_size) for n in lens]
    free = list(range(sum(blocks)))
    rng.shuffle(free)
    table = torch.zeros(len(lens), max(blocks), dtype=torch.int32)
    for i, n in enumerate(blocks):
        for b in range(n):
            table[i, b] = free.pop()
    return table, sum(blocks)


def main(library: str) -> None:
    torch.set_num_threads(2)
    torch._C._cpu._init_amx()
    torch.ops.load_library(library)
    ours = torch.ops.pagedserve_cpu.paged_attention
    rng = random.Random(0)
    lens = [rng.randint(375, 625) + 1 for _ in range(SEQS)]
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    starts = torch.arange(SEQS + 1, dtype=torch.int32)
    for dtype, isa in ((torch.float32, "vec"), (torch.bfloat16, "amx" if torch.cpu._is_amx_tile_supported() else "vec")):
        vllm_table, vllm_blocks = block_table(lens, 128, rng)
        our_table, our_blocks = block_table(lens, 16, rng)
        vllm_caches = [torch.randn(vllm_blocks, KV_HEADS, 256, HEAD_DIM).to(dtype).chunk(2, dim=2) for _ in range(CACHES)]
        our_caches = [(torch.randn(our_blocks, 16, KV_HEADS, HEAD_DIM).to(dtype),
                       torch.randn(our_blocks, 16, KV_HEADS, HEAD_DIM).to(dtype)) for _ in range(CACHES)]
        query = torch.randn(SEQS, HEADS, HEAD_DIM).to(dtype)
        out = torch.empty_like(query)
        metadata = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=SEQS, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, seq_lens=seq_lens, dtype=dtype,
            query_start_loc=starts, causal=True, sliding_window_size=-1, isa=isa, enable_kv_split=False)

        def vllm_op(i: int) -> None:
            k, v = vllm_caches[i % CACHES]
            ops.cpu_attention_with_kv_cache(
                query=query, key_cache=k, value_cache=v, output=out, query_start_loc=starts, seq_lens=seq_lens,
                scale=HEAD_DIM ** -0.5, causal=True, alibi_slopes=None, sliding_window=-1, block_table=vllm_table,
                softcap=0.0, scheduler_metadata=metadata, s_aux=None)

        def our_op(i: int) -> None:
            k, v = our_caches[i % CACHES]
            ours(out, query, k, v, our_table, seq_lens, starts, HEAD_DIM ** -0.5)

        times: dict[str, list[float]] = {"vllm": [], "pagedserve": []}
        for r in range(ROUNDS):  # alternate the order, so drift hits both
            pair = (("vllm", vllm_op), ("pagedserve", our_op))
            for name, op in pair if r % 2 else pair[::-1]:
                start = time.perf_counter()
                for i in range(2 * CACHES):
                    op(i)
                times[name].append((time.perf_counter() - start) / (2 * CACHES) * 1e3)
        kv_bytes = 2 * sum(lens) * KV_HEADS * HEAD_DIM * dtype.itemsize
        v_ms, p_ms = (statistics.median(times[n][2:]) for n in ("vllm", "pagedserve"))
        print(f"{str(dtype).removeprefix('torch.')}: vLLM ({isa}, block 128) {v_ms:.2f} ms {kv_bytes / v_ms / 1e6:.1f} GB/s"
              f" | pagedserve {p_ms:.2f} ms {kv_bytes / p_ms / 1e6:.1f} GB/s | vLLM / pagedserve time {v_ms / p_ms:.2f}",
              flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
