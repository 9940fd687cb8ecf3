"""write_kv_cache (Triton) against write_kv_cache_ref."""

import pytest
import torch

from kernel_test_utils import DEVICE, randn
from pagedserve_kernels.kv_cache_write import write_kv_cache
from pagedserve_kernels.reference import write_kv_cache_ref

DTYPES = [torch.float32, torch.float16, torch.bfloat16]  # pure copy: bf16 is exact on CPU too


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size,num_kv_heads,head_dim,slot_dtype",
                         [(8, 2, 64, torch.int64), (16, 3, 64, torch.int32),
                          (32, 1, 128, torch.int64)])
def test_write_matches_reference(dtype, block_size, num_kv_heads, head_dim, slot_dtype):
    gen = torch.Generator().manual_seed(block_size + num_kv_heads)
    num_blocks, num_tokens = 6, 13
    k_cache = randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, gen=gen)
    v_cache = randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, gen=gen)
    key = randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, gen=gen)
    value = randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, gen=gen)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[4] = -1  # padding token: must be skipped
    slots = slots.to(slot_dtype).to(DEVICE)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    write_kv_cache_ref(key, value, k_ref, v_ref, slots)
    write_kv_cache(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_ref)
    assert torch.equal(v_cache, v_ref)


def test_write_from_fused_qkv_view():
    """key/value as strided views of a fused QKV projection output."""
    gen = torch.Generator().manual_seed(1)
    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 64, 16
    qkv = randn(5, (num_heads + 2 * num_kv_heads) * head_dim, dtype=torch.float32, gen=gen)
    key = qkv[:, num_heads * head_dim:(num_heads + num_kv_heads) * head_dim].view(
        5, num_kv_heads, head_dim)
    value = qkv[:, (num_heads + num_kv_heads) * head_dim:].view(5, num_kv_heads, head_dim)
    assert not key.is_contiguous()
    k_cache = torch.zeros(2, block_size, num_kv_heads, head_dim, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([0, 17, 3, 31, 16], device=DEVICE)
    write_kv_cache(key, value, k_cache, v_cache, slots)
    k_ref, v_ref = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    write_kv_cache_ref(key, value, k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def _args(dtype=torch.float32, slot_dtype=torch.int64, kv_heads=2, cache_dtype=None):
    k_cache = torch.zeros(2, 8, 2, 64, dtype=cache_dtype or dtype, device=DEVICE)
    key = torch.zeros(3, kv_heads, 64, dtype=dtype, device=DEVICE)
    slots = torch.arange(3, device=DEVICE).to(slot_dtype)
    return key, key.clone(), k_cache, k_cache.clone(), slots


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(cache_dtype=torch.float16), TypeError, "key dtype"),
    (dict(slot_dtype=torch.float32), TypeError, "slot_mapping"),
    (dict(kv_heads=3), ValueError, "key has shape"),
])
def test_write_validation(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        write_kv_cache(*_args(**kwargs))


def test_write_validation_slot_length_and_cache_shape():
    key, value, k_cache, v_cache, slots = _args()
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv_cache(key, value, k_cache, v_cache, slots[:2])
    with pytest.raises(ValueError, match="v_cache"):
        write_kv_cache(key, value, k_cache, v_cache[:1], slots)
    with pytest.raises(TypeError, match="key must be a torch.Tensor"):
        write_kv_cache(key.tolist(), value, k_cache, v_cache, slots)
