"""The C++ decode attention op with fewer work items than threads: each item's KV heads split over the
threads (``work_items.h``, ``make_work``), which must not change a bit of any output."""

from __future__ import annotations

import pytest
import torch

from tests.worker.test_cpu_attention import OP, _batch, needs_op

pytestmark = needs_op


def _run(md, q, k_cache, v_cache, num_seqs: int, threads: int) -> torch.Tensor:
    """The op over the batch's first ``num_seqs`` sequences on ``threads`` threads."""
    tokens = int(md.query_start_loc[num_seqs])
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = torch.full_like(q[:tokens], float("nan"))
        OP(out, q[:tokens].contiguous(), k_cache, v_cache, md.block_tables[:num_seqs].contiguous(),
           md.seq_lens[:num_seqs].contiguous(), md.query_start_loc[:num_seqs + 1].contiguous(), 0.125)
        return out
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (8, 8), (4, 1), (12, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seqs", [[(300, 1)], [(40, 20)], [(100, 1), (7, 1)]])  # one decode, two tiles, two decodes
def test_outputs_are_the_same_bits_whatever_the_threads_split(heads, kv_heads, dtype, seqs):
    """The sequences alone on 1 thread (whole items), on 2, 3 and 8 (items split into up to ``kv_heads``
    shares), and in a batch with 8 more decodes on 2 threads (items enough: none split): bit-identical."""
    md, q, _, _, k_cache, v_cache = _batch(7, seqs + [(30 + i, 1) for i in range(8)], 16, heads, kv_heads, 64, dtype)
    alone = _run(md, q, k_cache, v_cache, len(seqs), 1)
    assert not alone.isnan().any()
    for threads in (2, 3, 8):
        assert torch.equal(_run(md, q, k_cache, v_cache, len(seqs), threads), alone), threads
    batched = _run(md, q, k_cache, v_cache, len(seqs) + 8, 2)
    assert torch.equal(batched[: alone.shape[0]], alone) and not batched.isnan().any()
