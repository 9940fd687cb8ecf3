"""The streaming read the benches compare memory-bound kernels with: on the pages the kernels read from."""

import torch

from pagedserve.bench.streaming_read import STREAM_BYTES, Pages, read_buffer
from pagedserve.engine.models.huge_pages import HUGE_PAGE_BYTES


def test_the_yardstick_buffer_starts_on_a_huge_page_as_the_caches_and_weights_do():
    buffer = read_buffer(Pages.HUGE)
    assert buffer.dtype == torch.float32 and buffer.numel() * 4 == STREAM_BYTES
    assert buffer.data_ptr() % HUGE_PAGE_BYTES == 0
    assert buffer.sum().item() == STREAM_BYTES // 4


def test_the_small_page_buffer_is_torch_s_own_allocation_of_the_same_size():
    buffer = read_buffer(Pages.SMALL)
    assert buffer.numel() * 4 == STREAM_BYTES and buffer.sum().item() == STREAM_BYTES // 4
