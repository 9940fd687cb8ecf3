"""models/huge_pages.py: tensors carved in order from 2 MiB-aligned chunks, 64-byte aligned, never
overlapping; a tensor larger than a chunk gets its own; the chunk is marked for transparent huge pages
where the kernel offers them; the memory lives as long as a tensor views it; a CPU KV cache sits there."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from pagedserve.engine.kv_cache import KVCache, KVCacheSpec
from pagedserve.engine.models.huge_pages import ALIGN_BYTES, CHUNK_BYTES, HUGE_PAGE_BYTES, HugePageArena

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def test_tensors_follow_each_other_64_byte_aligned_from_a_2_mib_boundary():
    arena = HugePageArena()
    first = arena.empty((3, 5), torch.float32)      # 60 bytes, rounded up to 64
    second = arena.empty((7,), torch.bfloat16)      # 14 bytes
    third = arena.empty((2, 2, 16), torch.float32)
    assert first.data_ptr() % HUGE_PAGE_BYTES == 0
    assert second.data_ptr() - first.data_ptr() == 64
    assert third.data_ptr() - second.data_ptr() == 64
    assert (first.shape, first.dtype, second.shape, second.dtype) == ((3, 5), torch.float32, (7,), torch.bfloat16)
    assert first.is_contiguous() and third.is_contiguous()
    first.fill_(1.0), second.fill_(2.0), third.fill_(3.0)
    assert first.sum() == 15 and second.float().sum() == 14 and third.sum() == 192


def test_a_full_chunk_starts_a_new_one_and_a_large_tensor_gets_its_own():
    arena = HugePageArena()
    most = arena.empty((CHUNK_BYTES // 4 - 16,), torch.float32)  # all but 64 bytes of the first chunk
    rest = arena.empty((16,), torch.float32)                      # fits exactly
    beyond = arena.empty((1,), torch.float32)                     # a new chunk
    large = arena.empty((CHUNK_BYTES // 4 + 1,), torch.float32)   # larger than a chunk: a chunk of its own
    assert rest.data_ptr() == most.data_ptr() + CHUNK_BYTES - ALIGN_BYTES
    assert beyond.data_ptr() % HUGE_PAGE_BYTES == 0 and large.data_ptr() % HUGE_PAGE_BYTES == 0
    assert len({most.data_ptr(), beyond.data_ptr(), large.data_ptr()}) == 3
    large[-1] = 7.0
    assert large[-1] == 7.0


def test_an_empty_tensor_takes_no_room():
    arena = HugePageArena()
    assert arena.empty((0, 16), torch.float32).shape == (0, 16)
    a, b = arena.empty((1,), torch.float32), arena.empty((1,), torch.float32)
    assert b.data_ptr() - a.data_ptr() == ALIGN_BYTES


def test_the_memory_outlives_the_arena_while_a_tensor_views_it():
    tensor = HugePageArena().empty((1024,), torch.float32)
    tensor.copy_(torch.arange(1024.0))
    gc.collect()
    assert torch.equal(tensor, torch.arange(1024.0))


THP_OFF = not THP_MODE.exists() or "[never]" in THP_MODE.read_text()


def thp_eligible(tensor: torch.Tensor) -> str:
    """The ``THPeligible`` value of the mapping that holds ``tensor`` in /proc/self/smaps ("1": yes)."""
    start = tensor.data_ptr()
    smaps = Path("/proc/self/smaps").read_text().split("\n")
    for i, line in enumerate(smaps):
        fields = line.split()
        if fields and "-" in fields[0] and all(c in "0123456789abcdef-" for c in fields[0]):
            low, high = (int(x, 16) for x in fields[0].split("-"))
            if low <= start < high:
                entry = smaps[i + 1:i + 30]
                break
    else:
        raise AssertionError("the tensor's mapping is not in /proc/self/smaps")
    eligible = [line for line in entry if line.startswith("THPeligible:")]
    if not eligible:
        pytest.skip("this kernel's smaps has no THPeligible field (Linux < 5.0)")
    return eligible[0].split()[1]


@pytest.mark.skipif(THP_OFF, reason="transparent huge pages are off (or this is not Linux)")
def test_the_chunk_is_eligible_for_huge_pages():
    tensor = HugePageArena().empty((HUGE_PAGE_BYTES // 4,), torch.float32)
    tensor.fill_(1.0)
    assert thp_eligible(tensor) == "1"


@pytest.mark.skipif(THP_OFF, reason="transparent huge pages are off (or this is not Linux)")
def test_a_cpu_kv_cache_is_zeroed_memory_eligible_for_huge_pages_in_one_mapping_of_its_size():
    cache = KVCache(KVCacheSpec(2, 2, 64, 16, torch.float32), num_blocks=512)  # 4 MiB a layer, 16 MiB in all
    layers = cache.key_caches + cache.value_caches
    for layer in layers:
        assert layer.shape == (512, 16, 2, 64) and not layer.any()
        assert thp_eligible(layer) == "1"
    spans = sorted((t.data_ptr(), t.data_ptr() + t.nbytes) for t in layers)
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))  # 4 tensors, none overlapping
    assert spans[-1][1] - spans[0][0] == 4 * (4 << 20)  # back to back
    assert layers[0].untyped_storage().nbytes() == (16 << 20) + (2 << 20)  # one mapping: the cache + 2 MiB to align


def test_a_cpu_kv_cache_under_a_huge_page_takes_ordinary_memory():
    cache = KVCache(KVCacheSpec(3, 2, 16, 4, torch.float32), num_blocks=5, num_cpu_blocks=2)  # 6 x 2,560 bytes
    for layer in cache.key_caches + cache.value_caches:
        assert layer.shape == (5, 4, 2, 16) and not layer.any()
        assert layer.untyped_storage().nbytes() == 2560  # its own allocation, no 2 MiB page
