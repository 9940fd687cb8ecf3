"""Outputs recomputed after a preemption keep their bits, through the real services
(``engine/attention_layout.py``): a scheduler and one worker with a small KV cache and no admission
headroom run six greedy requests at once, preempting (recompute) as they grow; every token and every
logprob equals the in-process engine's with a cache that preempts nothing. Before, the recomputed outputs
went through the prefill op, and the logprobs after them moved by up to ~1.5e-5."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.e2e.processes import scheduler_stats, start_stack
from tests.e2e.test_stack import QUESTIONS, assert_all_blocks_free, chat_request, stream
from tests.markers import needs_prefill_op

pytestmark = [pytest.mark.e2e, pytest.mark.model, needs_prefill_op]

MAX_TOKENS = 200
NUM_REQUESTS = 6
KV_CACHE = "512KiB"  # the small model: 64 blocks of 16 slots, where six requests grow to ~90


def generated(responses) -> tuple[list[int], list[float]]:
    return ([t for r in responses for t in r.token_ids], [e.logprob for r in responses for e in r.logprobs])


@pytest.fixture(scope="module")
def uninterrupted(small_model) -> list[tuple[list[int], list[float]]]:
    from pagedserve.engine.sampling_params import SamplingParams
    from pagedserve.llm import LLM
    from pagedserve.text.tokenizer import ChatTurn

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
    outputs = LLM(small_model, kv_cache_memory="64MiB").chat([[ChatTurn("user", q)] for q in QUESTIONS[:NUM_REQUESTS]],
                                                             params)
    return [(list(o.token_ids), [e.logprob for e in o.samples[0].logprobs]) for o in outputs]


def test_outputs_recomputed_after_preemption_keep_their_logprobs_bit_for_bit(tmp_path, small_model, uninterrupted):
    stack = start_stack(tmp_path, small_model, num_workers=1, kv_cache_memory=KV_CACHE,
                        scheduler_args=("--admission-headroom", "0"))
    try:
        requests = [chat_request(q, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
                    for q in QUESTIONS[:NUM_REQUESTS]]
        with ThreadPoolExecutor(NUM_REQUESTS) as pool:
            got = list(pool.map(lambda r: generated(stream(stack.gateway, r)), requests))
        assert scheduler_stats(stack.scheduler).num_preemptions > 0
        assert got == uninterrupted
        assert_all_blocks_free(stack)
    finally:
        stack.stop()
