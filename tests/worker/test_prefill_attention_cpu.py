"""The C++ prefill attention op for CPU (csrc/prefill_attention_cpu.cpp) against a float64 reference,
and the properties its header states: bits independent of the thread count and of the other rows, and
the same bits read in place through a block table as from a gathered copy."""

from __future__ import annotations

import pytest
import torch

from pagedserve.engine.attention.prefill_op import prefill_attention_paged, prefill_attention, prefill_op_available

pytestmark = pytest.mark.skipif(not prefill_op_available(), reason="needs AVX2, FMA and a C++ compiler")


def _inputs(seed: int, q: int, L: int, heads: int, kv_heads: int, dim: int):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(q, heads, dim, generator=g), torch.randn(L, kv_heads, dim, generator=g),
            torch.randn(L, kv_heads, dim, generator=g))


def _reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention in float64, the new tokens last: ``[q, H, D]`` over ``[L, Hkv, D]``."""
    q, heads, dim = query.shape
    L, kv_heads, _ = key.shape
    group = heads // kv_heads
    k = key.double().repeat_interleave(group, dim=1).transpose(0, 1)       # (H, L, D)
    v = value.double().repeat_interleave(group, dim=1).transpose(0, 1)     # (H, L, D)
    scores = query.double().transpose(0, 1) @ k.transpose(1, 2) * scale     # (H, q, L)
    allowed = torch.arange(L)[None, :] <= torch.arange(q)[:, None] + (L - q)
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return (probs @ v).transpose(0, 1)                                      # (q, H, D)


@pytest.mark.parametrize("q,L,heads,kv_heads,dim", [
    (1, 1, 9, 3, 64),        # a one-token prompt
    (37, 37, 9, 3, 64),      # the default model's heads, a length no tile divides
    (17, 17, 4, 4, 16),      # multi-head (group 1)
    (70, 200, 16, 2, 32),    # group 8 after 130 cached positions
    (130, 130, 8, 8, 128),   # wide heads, more than two key blocks
    (65, 300, 71, 1, 64),    # multi-query with 71 heads: an item holds part of a token's group
    (200, 1000, 9, 3, 64),   # long context
])
def test_op_matches_a_float64_reference(q, L, heads, kv_heads, dim):
    query, key, value = _inputs(q + L, q, L, heads, kv_heads, dim)
    got = prefill_attention(query, key, value, dim ** -0.5)
    assert got.shape == (q, heads, dim) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), _reference(query, key, value, dim ** -0.5), rtol=0, atol=4e-6)


def test_strided_key_value_views_read_as_their_contiguous_copies():
    query, key, value = _inputs(3, 20, 50, 6, 2, 32)
    wide_k, wide_v = (torch.cat([t, torch.randn_like(t)], dim=1)[:, :2] for t in (key, value))  # row stride 4 x 32
    assert not wide_k.is_contiguous()
    assert torch.equal(prefill_attention(query, wide_k, wide_v, 0.2), prefill_attention(query, key, value, 0.2))


def test_bits_do_not_depend_on_the_thread_count():
    """A 16-token chunk after 284 positions is split into other work items on 1, 2 and 3 threads (48, 18 and
    12 rows of a KV head each); its rows are the same bits."""
    query, key, value = _inputs(5, 16, 300, 9, 3, 64)
    threads = torch.get_num_threads()
    outputs = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outputs.append(prefill_attention(query, key, value, 0.125))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outputs[0], outputs[1]) and torch.equal(outputs[0], outputs[2])


@pytest.mark.parametrize("position", [0, 15, 16, 63, 64, 150, 199])
def test_a_token_gets_the_same_bits_in_a_whole_prompt_and_as_a_one_token_chunk(position):
    """The sums of a row run over the same key blocks in the same order whatever the rows beside it:
    a chunked prefill's last token equals the same token of the prompt prefilled at once."""
    query, key, value = _inputs(7, 200, 200, 9, 3, 64)
    whole = prefill_attention(query, key, value, 0.125)
    alone = prefill_attention(query[position:position + 1], key[:position + 1], value[:position + 1], 0.125)
    assert torch.equal(alone[0], whole[position])


@pytest.mark.parametrize("q,L,heads,kv_heads,dim,message", [
    (5, 4, 4, 2, 16, "query length 5 not in 1..context length 4"),
    (4, 4, 0, 2, 16, "multiple of KV heads"),
    (4, 4, 4, 2, 24, "multiple of 16"),
    (4, 4, 6, 4, 16, "multiple of KV heads"),
])
def test_bad_shapes_are_refused(q, L, heads, kv_heads, dim, message):
    query, key, value = _inputs(1, q, L, heads, kv_heads, dim)
    with pytest.raises(RuntimeError, match=message):
        prefill_attention(query, key, value, 0.25)


@pytest.mark.parametrize("block_size,q,context_len,heads,kv_heads", [
    (16, 16, 1484, 9, 3),    # a 16-token chunk after 1,484 cached positions, the default model's heads
    (16, 1, 0, 9, 3),        # a one-token prompt
    (8, 37, 5, 4, 4),        # multi-head, a context that ends mid-block
    (32, 70, 130, 16, 2),    # group 8, several key blocks
    (128, 20, 300, 9, 3),    # vLLM CPU's block size: a block longer than the op's 64-key steps
    (24, 40, 100, 6, 2),     # blocks that neither divide 64 nor are a multiple of it: runs cut mid-step
    (48, 70, 130, 16, 2),
])
def test_in_place_reads_give_the_bits_of_the_gathered_copy(block_size, q, context_len, heads, kv_heads):
    """Shuffled blocks whose unused rows (the last block's tail, every block the sequence does not own) hold
    NaN: none reaches the output (a V row read would; a K row past the context is masked anyway), and the
    output equals the op over the same positions gathered, bit for bit."""
    length, dim = context_len + q, 64
    num_blocks = -(-length // block_size)
    g = torch.Generator().manual_seed(block_size + q)
    key_cache, value_cache = (torch.full((2 * num_blocks + 3, block_size, kv_heads, dim), float("nan")) for _ in "kv")
    block_ids = torch.randperm(2 * num_blocks + 3, generator=g)[:num_blocks]
    key, value = (torch.randn(length, kv_heads, dim, generator=g) for _ in range(2))
    for cache, rows in ((key_cache, key), (value_cache, value)):
        for p in range(length):
            cache[block_ids[p // block_size], p % block_size] = rows[p]
    query = torch.randn(q, heads, dim, generator=g)
    got = prefill_attention_paged(query, key_cache, value_cache, block_ids, context_len, dim ** -0.5)
    assert not got.isnan().any()
    assert torch.equal(got, prefill_attention(query, key, value, dim ** -0.5))
    longer = torch.cat([block_ids, torch.tensor([-1, 10 ** 6])])  # entries past the sequence's blocks: unread
    assert torch.equal(prefill_attention_paged(query, key_cache, value_cache, longer, context_len, dim ** -0.5), got)


@pytest.mark.parametrize("change,message", [
    (dict(block_ids=torch.tensor([0, 9])), "block id 9 outside the cache of 4 blocks"),
    (dict(block_ids=torch.tensor([0, -1])), "block id -1 outside"),
    (dict(block_ids=torch.tensor([0])), "need 2 blocks, block_ids has 1"),
    (dict(block_ids=torch.tensor([0, 1], dtype=torch.int32)), "block_ids must be contiguous int64"),
    (dict(context_len=-1), "context_len -1 not in 0..32"),
    (dict(context_len=2 ** 62), "not in 0..32"),
    (dict(dtype=torch.bfloat16), "the caches must be contiguous float32"),
])
def test_in_place_reads_refuse_what_would_read_outside_the_cache(change, message):
    kwargs = {"block_ids": torch.tensor([0, 1]), "context_len": 10, "dtype": torch.float32, **change}
    cache = torch.zeros(4, 8, 2, 16, dtype=kwargs["dtype"])
    with pytest.raises(RuntimeError, match=message):
        prefill_attention_paged(torch.zeros(4, 4, 16), cache, cache.clone(), kwargs["block_ids"], kwargs["context_len"],
                                0.25)
