"""``LLM(tensor_parallel_size=2)``: greedy tokens equal TP=1 (prefix caching, preemption); a dead or
stuck helper rank makes the step raise within a bound instead of hanging."""

from __future__ import annotations

import os
import random
import signal
import time

import pytest

from pagedserve.engine.parallel.group import CollectiveError
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.llm import LLM
from tests.worker.tiny_models import save_tiny_model, save_tiny_tokenizer

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
BLOCK = 4
BLOCK_BYTES_TP1 = 2 * 2 * BLOCK * 2 * 16 * 4  # K+V, 2 layers, 4 slots, 2 KV heads, head_dim 16, float32
NUM_BLOCKS = 24  # 96 token slots for 12 prompts of up to 41 tokens: preemption happens
TIMEOUT_BOUND_S = 20.0  # the collectives' 5 s timeout plus slack on two busy cores


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = save_tiny_tokenizer(save_tiny_model(tmp_path_factory.mktemp("tp"), "llama", seed=7))
    rng = random.Random(3)
    shared = [rng.randrange(3, 96) for _ in range(9)]
    prompts = [[rng.randrange(3, 96) for _ in range(n)] for n in (1, 4, 7, 13, 20, 31, 5, 9, 26, 2)]
    return folder, prompts + [shared + [17, 18], shared + [40, 41, 42, 43, 44]]


def _tokens(llm: LLM, prompts) -> list[list[int]]:
    return [list(r.token_ids) for r in llm.generate(prompts, GREEDY)]


def test_tp2_greedy_equals_tp1_with_prefix_caching_and_preemption(tiny):
    folder, prompts = tiny
    single = LLM(folder, kv_cache_memory=NUM_BLOCKS * BLOCK_BYTES_TP1, block_size=BLOCK)
    reference = [_tokens(single, prompts) for _ in range(2)]  # the second round hits the prefix cache
    # Each rank holds 1 of the 2 KV heads: half the bytes per rank give the same number of blocks.
    with LLM(folder, kv_cache_memory=NUM_BLOCKS * BLOCK_BYTES_TP1 // 2, block_size=BLOCK,
             tensor_parallel_size=2) as llm:
        assert llm.stats().workers[0].num_blocks == NUM_BLOCKS
        assert [_tokens(llm, prompts) for _ in range(2)] == reference
        stats = llm.stats()
        assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0


@pytest.mark.parametrize("how", ["killed", "stopped"])
def test_a_dead_or_stuck_helper_fails_the_step(tiny, how):
    folder, prompts = tiny
    llm = LLM(folder, kv_cache_memory=NUM_BLOCKS * BLOCK_BYTES_TP1, block_size=BLOCK, tensor_parallel_size=2)
    try:
        assert len(_tokens(llm, prompts[:2])) == 2
        runner = llm._runners["worker-0"]
        helper = runner.helpers[0][0]
        os.kill(helper.pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(CollectiveError) as failure:
            llm.generate(prompts[:2], GREEDY)
        print(failure.value)
        elapsed = time.monotonic() - started
        print(f"{how}: the step raised after {elapsed:.1f} s")
        assert elapsed < TIMEOUT_BOUND_S
        with pytest.raises(CollectiveError):  # the worker stays failed
            runner.execute(None)
        if how == "stopped":
            os.kill(helper.pid, signal.SIGKILL)
    finally:
        llm.close()


def test_tp2_seeded_sampling_n2_and_logprobs_equal_tp1(tiny):
    """Seeded random sampling with n=2, output and prompt logprobs: the same tokens over TP=2 (the
    sampler runs on rank 0 with the same per-request seeds), logprobs within 1e-4."""
    folder, prompts = tiny
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=17, n=2, logprobs=2, prompt_logprobs=2,
                            ignore_eos=True)
    single = LLM(folder, kv_cache_memory=NUM_BLOCKS * BLOCK_BYTES_TP1, block_size=BLOCK).generate(prompts[:4], params)
    with LLM(folder, kv_cache_memory=NUM_BLOCKS * BLOCK_BYTES_TP1, block_size=BLOCK, tensor_parallel_size=2) as llm:
        split = llm.generate(prompts[:4], params)
    for ours, ref in zip(split, single):
        assert [list(s.token_ids) for s in ours.samples] == [list(s.token_ids) for s in ref.samples]
        for s, r in zip(ours.samples, ref.samples):
            assert s.cumulative_logprob == pytest.approx(r.cumulative_logprob, abs=1e-4)
        got = [p.logprob for p in ours.prompt_logprobs[1:]]
        want = [p.logprob for p in ref.prompt_logprobs[1:]]
        assert got == pytest.approx(want, abs=1e-4)
