"""With ``--prefix-cache-outputs own`` prefix caching never changes a request's bits, through the real
services: a chat's next turn (the last prompt, its answer and a new message, as token ids) gets the logprobs
of an engine without prefix caching, though the answer's tokens were cached by the request that generated
them. Their K/V came from the decode attention op, a prompt's come from the prefill op (sums ~1e-5 apart):
blocks past a prompt are keyed by its length too (``block_hash.hash_full_blocks``), so the turn finds only
the first prompt's blocks. Shared (the default, and before the option), it finds the answer's and its
logprobs differ from a fresh prefill's."""

from __future__ import annotations

import pytest

from pagedserve.services.common.pb import generate_pb2 as gen
from tests.e2e.processes import start_stack
from tests.e2e.test_recompute_exact_stack import generated
from tests.e2e.test_stack import stream
from tests.markers import needs_prefill_op

pytestmark = [pytest.mark.e2e, pytest.mark.model, needs_prefill_op]

FIRST = [(13 * j) % 40000 + 100 for j in range(64)]
NEW_MESSAGE = [(7 * j) % 30000 + 200 for j in range(20)]


def token_request(ids: list[int], max_tokens: int, **sampling) -> gen.GenerateRequest:
    params = gen.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **sampling)
    return gen.GenerateRequest(prompt_token_ids=gen.TokenIds(ids=ids), sampling_params=params)


def test_a_next_turn_holding_an_earlier_answer_gets_the_logprobs_of_a_fresh_prefill(tmp_path, small_model):
    from pagedserve.engine.sampling_params import SamplingParams
    from pagedserve.llm import LLM

    stack = start_stack(tmp_path, small_model, num_workers=1, scheduler_args=("--prefix-cache-outputs", "own"))
    try:
        answer, _ = generated(stream(stack.gateway, token_request(FIRST, max_tokens=48)))
        turn = FIRST + answer + NEW_MESSAGE
        got = generated(stream(stack.gateway, token_request(turn, max_tokens=8, logprobs=3)))
    finally:
        stack.stop()
    fresh = LLM(small_model, kv_cache_memory="64MiB", enable_prefix_caching=False)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3)
    sample = fresh.generate(turn, params)[0].samples[0]
    assert got == (list(sample.token_ids), [e.logprob for e in sample.logprobs])
