"""Prefix-aware placement through the real services (two workers): a request whose prompt shares
a long prefix with one still running on a worker goes to that worker and reads its cached blocks,
though the other worker has more free blocks (``--placement least-loaded`` would send it there)."""

from __future__ import annotations

import threading

import pytest

from tests.e2e.processes import scheduler_stats, wait_until
from pagedserve.services.common.pb import generate_pb2 as gen
from tests.e2e.test_stack import assert_all_blocks_free, stream

pytestmark = [pytest.mark.e2e, pytest.mark.model]

SYSTEMS = [f"Reference {i}: " + " ".join(f"{word}{i}" for word in ("amber", "basalt", "cobalt", "dune", "ember") * 14)
           for i in range(3)]  # about 200 tokens each, unique to this test


def _system_request(system: str, question: str, max_tokens: int) -> gen.GenerateRequest:
    request = gen.GenerateRequest(sampling_params=gen.SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                     ignore_eos=True))
    request.chat.messages.add(role="system", content=system)
    request.chat.messages.add(role="user", content=question)
    return request


def test_a_request_sharing_a_running_prefix_lands_on_its_worker(stack):
    assert_all_blocks_free(stack)
    for system in SYSTEMS:
        before = scheduler_stats(stack.scheduler).prefix_cache_hits
        first = threading.Thread(target=stream, args=(stack.gateway, _system_request(system, "Say one word.", 40)))
        first.start()
        wait_until(lambda: scheduler_stats(stack.scheduler).num_running == 1, "the first request running", 60)
        second = stream(stack.gateway, _system_request(system, "Say two words.", 2))
        assert second[-1].finish_reason
        hits = scheduler_stats(stack.scheduler).prefix_cache_hits - before
        first.join(120)
        assert hits >= 160, (system[:12], hits)  # the 172-token system prompt's full blocks, read from the cache
    assert_all_blocks_free(stack)
