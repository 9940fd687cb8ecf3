"""Triton kernel scattering new keys/values into the paged KV cache.

Each new token's K and V rows are written to the cache slot chosen by the
block manager (PagedAttention, Kwon et al., SOSP 2023, §4.1-4.2: the KV cache
is split into fixed-size blocks and a token's slot is
``block_id * block_size + offset_in_block``).

One program per token copies all of that token's KV heads (a
``[BLOCK_H, BLOCK_D]`` tile) for both K and V.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve_kernels._checks import (INDEX_DTYPES, KV_DTYPES, check_kv_cache, check_same_device,
                             check_same_dtype, check_shape, check_tensor, next_pow2)


@triton.jit
def _write_kv_cache_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_key_t, stride_key_h, stride_val_t, stride_val_h,
    stride_kc_b, stride_kc_s, stride_kc_h,
    stride_vc_b, stride_vc_s, stride_vc_h,
    num_kv_heads, head_dim,
    BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:  # padding token: nothing to write
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    offs_h = tl.arange(0, BLOCK_H)                                        # (BH,)
    offs_d = tl.arange(0, BLOCK_D)                                        # (BD,)
    mask = (offs_h[:, None] < num_kv_heads) & (offs_d[None, :] < head_dim)  # (BH, BD)

    k = tl.load(key_ptr + token * stride_key_t + offs_h[:, None] * stride_key_h
                + offs_d[None, :], mask=mask)                             # (BH, BD)
    v = tl.load(value_ptr + token * stride_val_t + offs_h[:, None] * stride_val_h
                + offs_d[None, :], mask=mask)                             # (BH, BD)
    k_dst = (k_cache_ptr + block * stride_kc_b + offset * stride_kc_s
             + offs_h[:, None] * stride_kc_h + offs_d[None, :])           # (BH, BD)
    v_dst = (v_cache_ptr + block * stride_vc_b + offset * stride_vc_s
             + offs_h[:, None] * stride_vc_h + offs_d[None, :])           # (BH, BD)
    tl.store(k_dst, k, mask=mask)
    tl.store(v_dst, v, mask=mask)


def _validate(key, value, k_cache, v_cache, slot_mapping) -> None:
    """Check shapes, dtypes and devices; raise ``TypeError``/``ValueError`` naming the argument."""
    _, _, num_kv_heads, head_dim = check_kv_cache(k_cache, v_cache)
    check_tensor("key", key, 3, KV_DTYPES)
    check_tensor("value", value, 3, KV_DTYPES)
    check_tensor("slot_mapping", slot_mapping, 1, INDEX_DTYPES)
    check_same_dtype("key", key, "k_cache", k_cache)
    check_same_dtype("value", value, "v_cache", v_cache)
    num_tokens = key.shape[0]
    check_shape("key", key, (num_tokens, num_kv_heads, head_dim))
    check_shape("value", value, (num_tokens, num_kv_heads, head_dim))
    check_shape("slot_mapping", slot_mapping, (num_tokens,))
    check_same_device(key=key, value=value, k_cache=k_cache, v_cache=v_cache,
                      slot_mapping=slot_mapping)


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write ``key``/``value`` rows into ``k_cache``/``v_cache`` at ``slot_mapping`` (in place).

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_dim]``, float16/bfloat16/
            float32/float8_e5m2, same dtype as the caches (rounded to it by the caller:
            ``kv_cache.to_cache_dtype``), last dimension contiguous.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        slot_mapping: ``[num_tokens]`` int64 (or int32),
            ``slot = block_id * block_size + offset_in_block``; a negative slot
            skips that token. Slots are not bounds-checked (that would need a
            device sync); the caller guarantees ``slot < num_blocks * block_size``.

    Raises:
        TypeError: a non-tensor argument or a wrong dtype (e.g. key dtype != cache dtype).
        ValueError: mismatched shapes, non-contiguous last dimension, mixed devices.
    """
    _validate(key, value, k_cache, v_cache, slot_mapping)
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    _write_kv_cache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        num_kv_heads, head_dim,
        BLOCK_SIZE=block_size, BLOCK_H=next_pow2(num_kv_heads), BLOCK_D=next_pow2(head_dim),
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
    )
