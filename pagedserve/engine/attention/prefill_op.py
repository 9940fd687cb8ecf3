"""The C++ prefill attention op for CPU (``csrc/prefill_attention_cpu.cpp``): causal attention of one
sequence's new tokens over its context in float32, in register-blocked tiles (FlashAttention-2's loop
order). torch's ``scaled_dot_product_attention`` runs the same products through small GEMM calls at
18 GFLOP/s on one AVX2 core for a 1000-token prompt (11 at 128 tokens); docs/benchmarks.md has both.

Built on first use like the paged op (:func:`~pagedserve.engine.attention.cpu_op.load_cpu_library`),
only on x86 CPUs with AVX2 and FMA, and used where ``cpu_features.own_kernels_preferred`` says it was
measured faster than torch's kernel (no AVX-512, or an AMD CPU); elsewhere, or where it cannot be built,
prefills keep torch's kernel. A bfloat16 model's prefills run it too, on their rows widened to float32
(exact) and the output rounded to bfloat16 once, as the decode op does.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from pagedserve.engine.cpu_features import cpu_flags, cpu_vendor, own_kernels_preferred

SOURCE = Path(__file__).parent / "csrc" / "prefill_attention_cpu.cpp"
HEAD_DIM_MULTIPLE = 16
"""The op's head_dim must be a multiple of this (its panels are 16 keys wide and its output blocks 16 columns)."""
IN_PLACE_MAX_TOKENS = 128
"""Context prefills of at most this many new tokens read a float32 cache in place
(:func:`prefill_attention_paged`); longer ones read a gathered copy. Every work item of the op streams its
KV head's V rows again, so with many items a contiguous copy, made once, pays for itself: in place gained
at 16-64 new tokens and stopped gaining from about 128 (docs/benchmarks.md, "Prefill attention in C++",
"Cached context read in place")."""


@functools.cache
def prefill_op_available() -> bool:
    """Whether this CPU has AVX2 and FMA and the op's library is built and loaded (on first use)."""
    if not {"avx2", "fma"} <= cpu_flags():
        return False
    from pagedserve.engine.attention.cpu_op import load_cpu_library

    return load_cpu_library(SOURCE, "pagedserve_prefill_attention", "the C++ prefill attention op for CPU",
                            "torch's scaled_dot_product_attention for prefills")


@functools.cache
def prefill_op_preferred() -> bool:
    """Whether the CPU backend sends prefills to the op: where ``own_kernels_preferred`` (no AVX-512, or an
    AMD CPU), and available (once a process: every attention call asks, and reading /proc/cpuinfo takes ~90 us)."""
    return own_kernels_preferred(cpu_flags(), cpu_vendor()) and prefill_op_available()


def prefill_op_applies(query: torch.Tensor) -> bool:
    """Whether the CPU backend sends the prefills of this query ``[q, H, D]`` to the op: float32 or
    bfloat16 (widened) on the CPU, ``D`` a multiple of 16, and :func:`prefill_op_preferred`."""
    return (query.dtype in (torch.float32, torch.bfloat16) and query.device.type == "cpu"
            and query.shape[-1] % HEAD_DIM_MULTIPLE == 0 and prefill_op_preferred())


def prefill_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of a sequence's ``q`` new tokens over its ``L`` context positions, the new ones
    last: new token ``i`` reads keys ``0 .. L - q + i``.

    Args:
        query: float32 ``[q, H, D]`` (made contiguous if it is not).
        key, value: float32 ``[L, Hkv, D]`` with ``L >= q``, ``H`` a multiple of ``Hkv``; each head's rows
            contiguous (any strides over the first two dimensions).
        scale: the factor of the scores, ``1 / sqrt(D)`` unless the model says otherwise.

    Returns:
        A new float32 ``[q, H, D]``.

    Raises:
        RuntimeError: the op is not available here (:func:`prefill_op_available`); from the op, for
            shapes or dtypes other than these.
    """
    return _run("prefill_attention", query, key, value, scale)


def prefill_attention_paged(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                            block_ids: torch.Tensor, context_len: int, scale: float) -> torch.Tensor:
    """:func:`prefill_attention` over a sequence's ``context_len + q`` positions read in place from one
    layer's cache (no gathered copy of its context): position ``p`` is row ``p % BS`` of block
    ``block_ids[p // BS]``. The same arithmetic in the same order, so the same bits as the gathered copy.

    Args:
        query: float32 ``[q, H, D]`` (made contiguous if it is not).
        key_cache, value_cache: float32 ``[NB, BS, Hkv, D]``, contiguous, the new tokens' K/V written.
        block_ids: int64 ``[>= ceil((context_len + q) / BS)]``, contiguous on the CPU: the sequence's blocks
            in order (entries past those are not read).
        context_len: cached positions before the new tokens, at most the cache's slots (``NB * BS``).
        scale: the factor of the scores.

    Returns:
        A new float32 ``[q, H, D]``.

    Raises:
        RuntimeError: the op is not available here; from the op, for other shapes or dtypes, or a block id
            outside the cache.
    """
    return _run("prefill_attention_paged", query, key_cache, value_cache, block_ids, context_len, scale)


def _run(name: str, query: torch.Tensor, *args) -> torch.Tensor:
    """The op ``name``'s output for ``query`` (made contiguous) and its other arguments ``args``."""
    if not prefill_op_available():
        raise RuntimeError("the prefill attention op needs an x86 CPU with AVX2 and FMA and a C++ compiler")
    query = query.contiguous()
    out = torch.empty_like(query)
    getattr(torch.ops.pagedserve_prefill, name)(out, query, *args)
    return out
