"""Admission headroom through the real services (engine/admission.py): the scheduler service started
with ``--admission-headroom 1`` keeps a second long request waiting while the first one's growth is
reserved, though its prompt would fit now; both streams end with the in-process engine's tokens."""

from __future__ import annotations

import threading

import pytest

from tests.e2e.processes import scheduler_stats, start_stack, wait_until
from tests.e2e.test_stack import QUESTIONS, assert_all_blocks_free, chat_request, stream

pytestmark = [pytest.mark.e2e, pytest.mark.model]

MAX_TOKENS = 900
KV_CACHE = "512KiB"  # the small model: 512 bytes a token, so 64 blocks of 16 slots


@pytest.fixture(scope="module")
def reference(small_model) -> list[int]:
    from pagedserve.engine.sampling_params import SamplingParams
    from pagedserve.llm import LLM
    from pagedserve.text.tokenizer import ChatTurn

    out = LLM(small_model, kv_cache_memory=KV_CACHE).chat(
        [[ChatTurn("user", QUESTIONS[0])]], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    return list(out[0].token_ids)


def test_a_request_waits_while_the_running_ones_growth_is_kept_free(tmp_path, small_model, reference):
    stack = start_stack(tmp_path, small_model, num_workers=1, kv_cache_memory=KV_CACHE,
                        scheduler_args=("--admission-headroom", "1"))
    try:
        tokens: dict[str, list[int]] = {}

        def run(name: str) -> None:
            request = chat_request(QUESTIONS[0], max_tokens=MAX_TOKENS, ignore_eos=True)
            tokens[name] = [t for r in stream(stack.gateway, request) for t in r.token_ids]

        first = threading.Thread(target=run, args=("first",))
        first.start()
        wait_until(lambda: scheduler_stats(stack.scheduler).num_running == 1, "the first request running", 60)
        second = threading.Thread(target=run, args=("second",))
        second.start()
        wait_until(lambda: scheduler_stats(stack.scheduler).num_waiting == 1, "the second request queued", 60)
        queued = scheduler_stats(stack.scheduler)
        wait_until(lambda: scheduler_stats(stack.scheduler).num_steps >= queued.num_steps + 20, "20 more steps", 60)
        stats = scheduler_stats(stack.scheduler)  # still queued 20 iterations on (admitted at once without headroom)
        # its prompt (a few blocks) fits in the free blocks; ~57 are kept for the first one's 900 tokens
        assert (stats.num_waiting, stats.num_running) == (1, 1) and stats.workers[0].num_free_blocks > 32, stats
        first.join(300)
        second.join(300)
        assert tokens == {"first": reference, "second": reference}
        assert_all_blocks_free(stack)
        # 64 blocks hold 1,024 of the model's 8,192-token context: the worker said so when it started
        assert ("the KV cache holds 1024 tokens (64 blocks of 16), fewer than the model's context of 8192"
                in stack.processes["worker-0"].log_text())
    finally:
        stack.stop()
