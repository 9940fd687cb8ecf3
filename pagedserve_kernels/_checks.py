"""Input validation shared by the Triton kernel launchers.

Every check raises before a kernel launch so that a bad argument produces a
clear ``TypeError`` (wrong dtype / not a tensor) or ``ValueError`` (wrong shape,
stride, device, or an unsupported size) that names the offending argument,
instead of an out-of-bounds memory access inside a kernel.

This module imports only torch, so it is usable without triton.
"""

from __future__ import annotations

import os

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
NARROW_CACHE_DTYPES = (torch.bfloat16, torch.float8_e5m2)
"""Cache dtypes the attention kernels read under a query of another dtype (widened per tile to float32;
``--kv-cache-dtype``)."""
KV_DTYPES = FLOAT_DTYPES + (torch.float8_e5m2,)
INDEX_DTYPES = (torch.int32, torch.int64)


def check_tensor(name: str, t, ndim: int, dtypes: tuple) -> None:
    """Check that ``t`` is a tensor of rank ``ndim`` whose dtype is in ``dtypes``.

    Raises:
        TypeError: ``t`` is not a tensor, or its dtype is not allowed.
        ValueError: wrong rank, or its last dimension is not contiguous.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d) for d in dtypes)
        raise TypeError(f"{name} has dtype {t.dtype}; expected one of: {allowed}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if t.numel() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension (stride(-1) == 1), "
                         f"got strides {t.stride()}")


def check_shape(name: str, t: torch.Tensor, expected: tuple) -> None:
    """Raise ``ValueError`` unless ``t.shape == expected``."""
    if tuple(t.shape) != tuple(expected):
        raise ValueError(f"{name} has shape {tuple(t.shape)}; expected {tuple(expected)}")


def check_same_device(**tensors: torch.Tensor) -> torch.device:
    """Raise ``ValueError`` unless all tensors are on one device; return that device.

    CPU tensors are only accepted when the Triton interpreter is enabled
    (``TRITON_INTERPRET=1``), since compiled Triton kernels need a GPU.
    """
    devices = {name: t.device for name, t in tensors.items()}
    first_name, first = next(iter(devices.items()))
    for name, dev in devices.items():
        if dev != first:
            raise ValueError(f"{name} is on {dev} but {first_name} is on {first}; "
                             "all tensors must be on the same device")
    if first.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") not in ("1", "true", "True"):
        raise ValueError("tensors are on the CPU: Triton kernels need a GPU, or set "
                         "TRITON_INTERPRET=1 before importing triton to run them in the "
                         "interpreter")
    return first


def check_alibi_slopes(slopes, query: torch.Tensor) -> None:
    """``None``, or float32 ``[num_heads]`` contiguous on the query's device (ALiBi slopes).

    Raises:
        TypeError: not a tensor, or not float32.
        ValueError: wrong shape, not contiguous, or another device.
    """
    if slopes is None:
        return
    check_tensor("alibi_slopes", slopes, 1, (torch.float32,))
    check_shape("alibi_slopes", slopes, (query.shape[1],))
    if not slopes.is_contiguous():
        raise ValueError("alibi_slopes must be contiguous")
    check_same_device(query=query, alibi_slopes=slopes)


def check_kv_cache(k_cache, v_cache) -> tuple[int, int, int, int]:
    """Validate a paged K/V cache pair, each ``[num_blocks, block_size, num_kv_heads, head_dim]``.

    Returns ``(num_blocks, block_size, num_kv_heads, head_dim)``.
    """
    check_tensor("k_cache", k_cache, 4, KV_DTYPES)
    check_tensor("v_cache", v_cache, 4, KV_DTYPES)
    if v_cache.dtype != k_cache.dtype:
        raise TypeError(f"v_cache dtype {v_cache.dtype} differs from k_cache dtype {k_cache.dtype}")
    check_shape("v_cache", v_cache, tuple(k_cache.shape))
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    if block_size < 1 or num_kv_heads < 1 or head_dim < 1:
        raise ValueError(f"k_cache has an empty dimension: shape {tuple(k_cache.shape)}")
    return num_blocks, block_size, num_kv_heads, head_dim


def check_heads(query: torch.Tensor, num_kv_heads: int, head_dim: int) -> int:
    """Check query heads against the cache; return the GQA group size.

    ``query`` is ``[num_tokens, num_heads, head_dim]``; ``num_heads`` must be a
    multiple of ``num_kv_heads`` and ``head_dim`` a power of two >= 16 (the
    minimum ``tl.dot`` operand size).
    """
    num_heads, q_head_dim = query.shape[1], query.shape[2]
    if q_head_dim != head_dim:
        raise ValueError(f"query head_dim {q_head_dim} differs from k_cache head_dim {head_dim}")
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two >= 16, got {head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"query num_heads {num_heads} is not a multiple of "
                         f"k_cache num_kv_heads {num_kv_heads}")
    return num_heads // num_kv_heads


def check_same_dtype(name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    """Raise ``TypeError`` unless ``t.dtype == ref.dtype``."""
    if t.dtype != ref.dtype:
        raise TypeError(f"{name} dtype {t.dtype} differs from {ref_name} dtype {ref.dtype}")


def check_cache_dtype(k_cache: torch.Tensor, query: torch.Tensor) -> None:
    """Raise ``TypeError`` unless the cache holds ``query``'s dtype or one of ``NARROW_CACHE_DTYPES``."""
    if k_cache.dtype != query.dtype and k_cache.dtype not in NARROW_CACHE_DTYPES:
        raise TypeError(f"k_cache dtype {k_cache.dtype} is neither query's dtype {query.dtype} nor one of "
                        f"{', '.join(map(str, NARROW_CACHE_DTYPES))}")


def check_out(out, like: torch.Tensor):
    """Validate an optional preallocated output; allocate one shaped like ``like`` if None."""
    if out is None:
        return torch.empty_like(like, memory_format=torch.contiguous_format)
    check_tensor("out", out, like.dim(), (like.dtype,))
    check_shape("out", out, tuple(like.shape))
    if out.device != like.device:
        raise ValueError(f"out is on {out.device} but query is on {like.device}")
    return out


def next_pow2(n: int) -> int:
    """Smallest power of two >= ``n`` (and >= 1)."""
    return 1 << max(0, int(n) - 1).bit_length()
