"""ALiBi position bias (Press et al., ICLR 2022, "Train Short, Test Long", §3) for the backends.

ALiBi adds no position embedding; every attention score of head ``h`` gets a linear bias
``-slope[h] * (query_pos - key_pos)`` (0 on the diagonal, more negative further back), with
geometric per-head slopes. The backends' convention (see ``backend.py``): the bias is added to the
*scaled* score, ``scale * q.k - slope[h] * (q_pos - k_pos)``, so a model whose reference adds the
bias before scaling (Falcon) passes ``slope * scale``. The relative form keeps the bias small next to
the diagonal; it equals an absolute ``slope * k_pos`` bias (BLOOM's, Falcon's) up to a per-row
constant, which softmax ignores.

transformers' Falcon (``build_alibi_tensor``) is not quite that: it computes ``slope * key_pos`` in
bfloat16 (the bf16 slope times the position rounded to bf16, the product rounded again: absolute key
positions, so keys far from position 0 get coarse biases) and adds it before scaling. A falcon-rw
checkpoint expects that form (1e-2 relative logit differences within 300 tokens without it, on
slopes that are not powers of two), so every backend also takes ``alibi_bf16=True``: bias
``scale * bf16(slope[h] * bf16(key_pos))`` with the raw (unscaled) slopes.

The torch helpers here build the additive float masks the torch backend hands to
``scaled_dot_product_attention``; the C++ op and the Triton kernels add the same bias in their score
loops.
"""

from __future__ import annotations

import math

import torch


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """The per-head slopes of Press et al. §3 with the non-power-of-two rule of their code (and of
    transformers' ``build_alibi_tensor`` for BLOOM and Falcon).

    For ``n`` a power of two the slopes are ``2^(-8/n), 2^(-16/n), ..., 2^(-8)``. Otherwise the ``c``
    slopes of ``c``, the largest power of two below ``n``, then the odd-indexed slopes of ``2c``
    (``2^(-4/c * (1, 3, 5, ...))``) for the remaining ``n - c`` heads.

    Returns:
        float32 ``[num_heads]``.
    """
    closest = 2 ** math.floor(math.log2(num_heads))
    base = torch.tensor(2 ** (-(2 ** -(math.log2(closest) - 3))), dtype=torch.float32)
    slopes = torch.pow(base, torch.arange(1, 1 + closest, dtype=torch.int32))            # (c,)
    if closest != num_heads:
        extra_base = torch.tensor(2 ** (-(2 ** -(math.log2(2 * closest) - 3))), dtype=torch.float32)
        remaining = min(closest, num_heads - closest)
        extra = torch.pow(extra_base, torch.arange(1, 1 + 2 * remaining, 2, dtype=torch.int32))  # (n-c,)
        slopes = torch.cat([slopes, extra])                                              # (n,)
    return slopes


def alibi_bias(slopes: torch.Tensor, query_pos: torch.Tensor, key_len: int,
               bf16_scale: float | None = None) -> torch.Tensor:
    """``-slope[h] * (query_pos[i] - j)`` for keys ``j < key_len``: float32 ``[H, q, key_len]``; with
    ``bf16_scale``, transformers' Falcon form ``bf16_scale * bf16(slope[h] * bf16(j))`` instead.

    Args:
        slopes: float32 ``[H]``.
        query_pos: int ``[q]``, the queries' positions in their sequence.
        key_len: key positions ``0..key_len-1``.
        bf16_scale: the softmax scale in the Falcon form, or ``None`` (relative, float32).
    """
    key_pos = torch.arange(key_len, device=slopes.device, dtype=torch.float32)           # (L,)
    if bf16_scale is not None:
        key_bf16 = key_pos.bfloat16().float()                                            # (L,)
        bias = (slopes.float()[:, None] * key_bf16[None]).bfloat16().float() * bf16_scale  # (H, L)
        return bias[:, None, :].expand(-1, query_pos.shape[0], -1)                       # (H, q, L)
    rel = key_pos[None, :] - query_pos.to(slopes.device, torch.float32)[:, None]          # (q, L)
    return slopes.float()[:, None, None] * rel[None]                                     # (H, q, L)


def decode_mask(mask: torch.Tensor, slopes: torch.Tensor, seq_lens: torch.Tensor,
                num_kv_heads: int, bf16_scale: float | None = None) -> torch.Tensor:
    """The torch decode path's padding mask plus the bias of each sequence's one query (position
    ``seq_len - 1``).

    Args:
        mask: additive ``[Nd, 1, 1, L]`` (0 / ``-inf``) in the model dtype.
        slopes: float32 ``[H]``.
        seq_lens: int ``[Nd]``.
        num_kv_heads: query heads are grouped as ``[Hkv, G]`` (head ``h`` = ``kv * G + g``).
        bf16_scale: see :func:`alibi_bias`.

    Returns:
        ``[Nd, Hkv, G, L]`` in ``mask.dtype``.
    """
    num_seqs, length = mask.shape[0], mask.shape[-1]
    if bf16_scale is not None:  # the same bias row for every sequence
        bias = alibi_bias(slopes, seq_lens[:1], length, bf16_scale)                      # (H, 1, L)
        return (bias.view(1, num_kv_heads, -1, length) + mask).to(mask.dtype)            # (Nd, Hkv, G, L)
    key_pos = torch.arange(length, device=mask.device, dtype=torch.float32)              # (L,)
    rel = key_pos[None, :] - (seq_lens.to(mask.device, torch.float32) - 1)[:, None]      # (Nd, L)
    bias = slopes.float().view(1, num_kv_heads, -1, 1) * rel.view(num_seqs, 1, 1, length)  # (Nd, Hkv, G, L)
    return (bias + mask).to(mask.dtype)                                                  # (Nd, Hkv, G, L)


def prefill_mask(slopes: torch.Tensor, query_pos: torch.Tensor, key_len: int, num_kv_heads: int,
                 mask: torch.Tensor | None, dtype: torch.dtype, bf16_scale: float | None = None) -> torch.Tensor:
    """The bias plus the causal mask for one sequence's prefill, grouped as the torch backend's
    ``[Hkv, G, q, L]`` attention.

    Args:
        slopes: float32 ``[H]``.
        query_pos: int ``[q]``, positions of the new tokens.
        key_len: context positions read (the padded gather length with cached context).
        mask: additive ``[q, L]`` (0 / ``-inf``), or ``None`` for plain causal (``j <= query_pos``).
        dtype: the model dtype (``scaled_dot_product_attention`` wants the query's).
        bf16_scale: see :func:`alibi_bias`.

    Returns:
        ``[Hkv, G, q, L]`` in ``dtype``.
    """
    bias = alibi_bias(slopes, query_pos, key_len, bf16_scale)                                         # (H, q, L)
    if mask is None:
        key_pos = torch.arange(key_len, device=bias.device)                              # (L,)
        future = key_pos[None, :] > query_pos.to(bias.device)[:, None]                   # (q, L)
        bias = bias.masked_fill(future, float("-inf"))                                   # (H, q, L)
    else:
        bias = bias + mask.float()                                                       # (H, q, L)
    return bias.view(num_kv_heads, -1, *bias.shape[1:]).to(dtype)                        # (Hkv, G, q, L)
