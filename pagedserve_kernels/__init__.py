"""Triton kernels for the paged KV cache.

Public API (the Triton launchers are imported lazily, so ``import pagedserve_kernels`` and
``import pagedserve_kernels.reference`` work without triton installed):

    write_kv_cache(key, value, k_cache, v_cache, slot_mapping)
    paged_decode_attention(query, k_cache, v_cache, block_tables, seq_lens, scale,
                           num_splits=None, out=None, max_seq_len=None)
    paged_prefill_attention(query, k_cache, v_cache, block_tables, seq_lens,
                            query_start_loc, scale, max_query_len, out=None)

On a machine without a GPU, set ``TRITON_INTERPRET=1`` before triton is first
imported to run the kernels in the Triton interpreter.
"""

from importlib import import_module

_LAZY = {
    "write_kv_cache": "pagedserve_kernels.kv_cache_write",
    "paged_decode_attention": "pagedserve_kernels.decode_attention",
    "paged_prefill_attention": "pagedserve_kernels.prefill_attention",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pagedserve_kernels' has no attribute {name!r}")
