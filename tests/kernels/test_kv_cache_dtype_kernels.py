"""The Triton kernels over a cache narrower than the query (--kv-cache-dtype bfloat16 / fp8_e5m2):
widened per tile, all float32, so the float32 tolerance against the reference over the stored values."""

import pytest
import torch

from kernel_test_utils import DEVICE, assert_close, make_paged_kv, nan_like, randn
from pagedserve_kernels.decode_attention import paged_decode_attention
from pagedserve_kernels.prefill_attention import paged_prefill_attention
from pagedserve_kernels.reference import paged_attention_ref, paged_decode_attention_ref
from pagedserve.engine.attention import TorchAttentionBackend, TritonAttentionBackend
from pagedserve.engine.attention.metadata import build_attention_metadata, compute_positions
from pagedserve.engine.kv_cache import to_cache_dtype
from tests.kernels.test_engine_with_triton import greedy_outputs
from tests.worker.tiny_models import save_tiny_model

NARROW = (torch.bfloat16, torch.float8_e5m2)
NUM_KV_HEADS = 2


def _caches(seq_lens, block_size, head_dim, kv_dtype, gen):
    k_cache, v_cache, block_tables = make_paged_kv(seq_lens, block_size, NUM_KV_HEADS, head_dim, torch.float32, gen)
    return to_cache_dtype(k_cache, kv_dtype), to_cache_dtype(v_cache, kv_dtype), block_tables


@pytest.mark.parametrize("kv_dtype", NARROW)
@pytest.mark.parametrize("block_size,group,num_splits", [(16, 1, None), (8, 3, 2), (32, 8, None)])
def test_decode_widens_a_narrow_cache(kv_dtype, block_size, group, num_splits):
    gen = torch.Generator().manual_seed(1)
    seq_lens = [1, 17, 50, 130]  # ragged, mostly not multiples of the block size
    k_cache, v_cache, block_tables = _caches(seq_lens, block_size, 64, kv_dtype, gen)
    query = randn(len(seq_lens), NUM_KV_HEADS * group, 64, dtype=torch.float32, gen=gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out = nan_like(query)
    paged_decode_attention(query, k_cache, v_cache, block_tables, lens, 0.125, num_splits=num_splits, out=out)
    ref = paged_decode_attention_ref(query, k_cache.float(), v_cache.float(), block_tables, lens, 0.125)
    assert_close(out, ref, torch.float32)


@pytest.mark.parametrize("kv_dtype", NARROW)
@pytest.mark.parametrize("block_size,group", [(16, 1), (8, 3), (32, 8)])
def test_prefill_widens_a_narrow_cache(kv_dtype, block_size, group):
    gen = torch.Generator().manual_seed(2)
    batch = [(0, 19), (30, 1), (13, 7), (45, 33)]  # (cached prefix, new tokens): prefill and decode rows
    seq_lens, q_lens = [c + q for c, q in batch], [q for _, q in batch]
    k_cache, v_cache, block_tables = _caches(seq_lens, block_size, 64, kv_dtype, gen)
    query = randn(sum(q_lens), NUM_KV_HEADS * group, 64, dtype=torch.float32, gen=gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    qsl = torch.tensor([0] + q_lens, device=DEVICE).cumsum(0).to(torch.int32)
    out = nan_like(query)
    paged_prefill_attention(query, k_cache, v_cache, block_tables, lens, qsl, 0.125, max(q_lens), out=out)
    ref = paged_attention_ref(query, k_cache.float(), v_cache.float(), block_tables, lens, qsl, 0.125)
    assert_close(out, ref, torch.float32)


def test_kernels_refuse_a_cache_they_do_not_read():
    gen = torch.Generator().manual_seed(3)
    k_cache, v_cache, block_tables = make_paged_kv([9], 8, NUM_KV_HEADS, 64, torch.float16, gen)
    query = randn(1, 2, 64, dtype=torch.float32, gen=gen)
    with pytest.raises(TypeError, match="neither query's dtype"):
        paged_decode_attention(query, k_cache, v_cache, block_tables, torch.tensor([9], device=DEVICE), 0.125)


@pytest.mark.parametrize("kv_dtype", NARROW)
def test_triton_writes_round_as_the_torch_backend(kv_dtype):
    gen = torch.Generator().manual_seed(4)
    lens, tables = ([5, 3], [0, 6]), [[2, 0], [1, 3, 5]]
    key = randn(8, NUM_KV_HEADS, 64, dtype=torch.float32, gen=gen) * 3e4  # some beyond e5m2's 57344
    value = randn(8, NUM_KV_HEADS, 64, dtype=torch.float32, gen=gen)
    written = []
    for backend, device in ((TritonAttentionBackend(), DEVICE), (TorchAttentionBackend(), "cpu")):
        md = build_attention_metadata(*lens, tables, compute_positions(*lens), 4, device=device)
        caches = [torch.zeros(6, 4, NUM_KV_HEADS, 64, dtype=kv_dtype, device=device) for _ in range(2)]
        backend.write_kv(key.to(device), value.to(device), caches[0], caches[1], md)
        written.append([c.cpu().view(torch.uint8) for c in caches])
    assert all(torch.equal(a, b) for a, b in zip(*written))
    assert written[0][0].view(kv_dtype).float().isfinite().all()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", seed=5, hidden_size=128)  # head_dim 32


def test_engine_with_fp8_cache_decodes_alike_on_triton_and_torch(tiny):
    """Same stored values and float32 arithmetic on both backends: the same greedy tokens through
    prefill, chunked prefill and decode."""
    reference = greedy_outputs(tiny, "torch", kv_cache_dtype="fp8_e5m2")
    assert greedy_outputs(tiny, "triton", kv_cache_dtype="fp8_e5m2") == reference
