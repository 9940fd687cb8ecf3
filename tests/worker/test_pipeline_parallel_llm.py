"""``LLM(pipeline_parallel_size=2)`` (one or two virtual engines) and a 2 x 2 grid: greedy tokens equal
one rank's (prefix caching, preemption); a killed or stuck rank makes the step raise within a bound
instead of hanging."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from pagedserve.engine.messages import BatchPlan, CachedRequestData, SequenceId
from pagedserve.engine.model_runner import PlanMismatchError
from pagedserve.engine.parallel.group import CollectiveError
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.llm import LLM
from tests.worker.tiny_models import save_tiny_model
from tests.worker.tp_helpers import (BLOCK, BLOCK_BYTES_ONE_RANK, GREEDY, NUM_BLOCKS, TIMEOUT_BOUND_S,
                                     assert_a_dead_or_stuck_rank_fails_the_step,
                                     assert_seeded_sampling_equal_one_rank, generated_tokens as _tokens,
                                     tiny_model_and_prompts)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):  # 16 prompts
    return tiny_model_and_prompts(tmp_path_factory.mktemp("pp"), (1, 4, 7, 13, 20, 31, 5, 9, 26, 2, 3, 11, 17, 6))


@pytest.fixture(scope="module")
def reference(tiny):
    folder, prompts = tiny
    single = LLM(folder, kv_cache_memory=NUM_BLOCKS * BLOCK_BYTES_ONE_RANK, block_size=BLOCK)
    return [_tokens(single, prompts) for _ in range(2)]  # the second round hits the prefix cache


@pytest.mark.parametrize("sizes", [(1, 2, 1), (1, 2, 2), (2, 2, 2)], ids=["pp2", "pp2_ve2", "tp2xpp2_ve2"])
def test_pipeline_greedy_equals_one_rank_with_prefix_caching_and_preemption(tiny, reference, sizes):
    folder, prompts = tiny
    t, p, v = sizes
    # Each rank holds 1 of the 2 layers (and 1 of the 2 KV heads when T=2): 1/(T*P) of the bytes give
    # NUM_BLOCKS blocks, split between the V virtual engines; V times that gives each engine NUM_BLOCKS.
    with LLM(folder, kv_cache_memory=NUM_BLOCKS * BLOCK_BYTES_ONE_RANK * v // (t * p), block_size=BLOCK,
             tensor_parallel_size=t, pipeline_parallel_size=p, virtual_engines=v) as llm:
        assert [w.num_blocks for w in llm.stats().workers] == [NUM_BLOCKS] * v
        assert [_tokens(llm, prompts) for _ in range(2)] == reference
        stats = llm.stats()
        assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
        assert all(w.num_cached_blocks > 0 for w in stats.workers)  # every virtual engine ran sequences


def test_kv_capacity_grows_with_stages_and_is_split_among_virtual_engines(tiny):
    folder, _ = tiny
    with LLM(folder, kv_cache_memory=NUM_BLOCKS * BLOCK_BYTES_ONE_RANK, block_size=BLOCK,
             pipeline_parallel_size=2) as llm:
        assert [(w.worker_id, w.num_blocks) for w in llm.stats().workers] == [
            ("worker-0/ve0", NUM_BLOCKS), ("worker-0/ve1", NUM_BLOCKS)]


def test_a_rank_killed_mid_step_fails_the_step(tiny):
    """The last stage is stopped while rank 0 runs stage 0 (gloo's send then waits for the receiver)
    and waits for the result; the last stage is then killed: the step raises within 2 s."""
    folder, prompts = tiny
    llm = LLM(folder, kv_cache_memory=NUM_BLOCKS * BLOCK_BYTES_ONE_RANK, block_size=BLOCK, pipeline_parallel_size=2,
              virtual_engines=1)
    try:
        runner = llm._runners["worker-0"]
        last_stage = runner.pipeline.helpers[0][0]
        os.kill(last_stage.pid, signal.SIGSTOP)
        failure: list[BaseException] = []

        def generate() -> None:
            try:
                llm.generate(prompts[:2], GREEDY)
            except CollectiveError as exc:
                failure.append(exc)

        step = threading.Thread(target=generate)
        step.start()
        time.sleep(1.0)  # rank 0 is in its send to the last stage, or waits for the result
        assert step.is_alive()
        started = time.monotonic()
        os.kill(last_stage.pid, signal.SIGKILL)
        step.join(timeout=TIMEOUT_BOUND_S)
        assert not step.is_alive() and len(failure) == 1
        assert time.monotonic() - started < 2.0
    finally:
        llm.close()


@pytest.mark.parametrize("how", ["killed", "stopped"])
def test_a_dead_or_stuck_last_stage_fails_the_step(tiny, how):
    folder, prompts = tiny
    llm = LLM(folder, kv_cache_memory=NUM_BLOCKS * BLOCK_BYTES_ONE_RANK, block_size=BLOCK, pipeline_parallel_size=2)
    try:
        assert len(_tokens(llm, prompts[:2])) == 2
        runner = llm._runners["worker-0/ve0"]
        runner.pipeline.result_timeout_s = 5.0  # a stopped last stage: no result (its recv may not block us)
        last_stage = runner.pipeline.helpers[0][0]
        assert_a_dead_or_stuck_rank_fails_the_step(llm, runner, last_stage.pid, how, prompts[:2])
    finally:
        llm.close()


def test_pp2_seeded_sampling_n2_and_logprobs_equal_one_rank(tiny):
    """The last stage samples with the same per-request seeds as one rank."""
    folder, prompts = tiny
    assert_seeded_sampling_equal_one_rank(folder, prompts[:4], pipeline_parallel_size=2)


def test_a_plan_that_does_not_apply_is_refused_and_the_worker_goes_on(tiny, reference):
    """A cached sequence no rank holds: every rank refuses the plan alike (PlanMismatchError, the
    sampling rank's answer included), the worker is not broken, and the next prompts run."""
    folder, prompts = tiny
    with LLM(folder, kv_cache_memory=NUM_BLOCKS * BLOCK_BYTES_ONE_RANK, block_size=BLOCK,
             pipeline_parallel_size=2, virtual_engines=1) as llm:
        assert _tokens(llm, prompts[:3]) == reference[0][:3]
        runner = llm._runners["worker-0"]
        session = runner.pipeline.runners[0]._session_id
        stray = CachedRequestData(SequenceId("nobody", 0), (), 0, 1)
        with pytest.raises(PlanMismatchError, match="unknown to the worker"):
            runner.execute(BatchPlan(step_id=10**6, cached_requests=(stray,), session_id=session))
        assert runner.broken is None
        assert _tokens(llm, prompts[3:6]) == reference[0][3:6]


NGRAM = {"method": "ngram", "control": "fixed", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def other_model(tmp_path_factory):
    """Another tiny Llama (seed 8) of the same vocabulary: a draft the target often rejects."""
    return save_tiny_model(tmp_path_factory.mktemp("draft"), "llama", seed=8)


@pytest.mark.parametrize("method", ["ngram", "self_draft", "other_draft"])
@pytest.mark.parametrize("sizes", [(1, 2, 2), (2, 2, 2)], ids=["pp2_ve2", "tp2xpp2_ve2"])
def test_pipeline_speculation_gives_one_ranks_greedy_tokens_and_seeded_samples(tiny, other_model, reference, sizes,
                                                                              method):
    """The first stage drafts (n-gram, or a draft model beside its layers on its tensor-parallel rank 0:
    the model itself, which has every draft accepted, or another one, which has many rejected) and
    passes the drafts on, the last stage verifies, and the other stages count the accepted drafts when
    the tokens come with the engine's next plan (preemption and prefix hits included); the draft's
    cache costs every stage the same blocks."""
    folder, prompts = tiny
    t, p, v = sizes
    draft = {"self_draft": folder, "other_draft": other_model}.get(method)
    speculative = NGRAM if draft is None else {**NGRAM, "method": "draft_model", "model": str(draft)}
    # a rank's block holds 1 / (t * p) of one rank's (its layers and heads); a draft's block beside it the whole
    draft_blocks = 0 if draft is None else 1
    sampled = SamplingParams(max_tokens=12, temperature=1.0, seed=5, ignore_eos=True)
    short = [q for q in prompts if len(q) <= 7][:4]  # no lookahead dropped for want of blocks (see the TP test)
    one_rank = LLM(folder, kv_cache_memory=NUM_BLOCKS * BLOCK_BYTES_ONE_RANK * (1 + draft_blocks), block_size=BLOCK,
                   speculative_config=speculative)
    want_sampled = [r.token_ids for r in one_rank.generate(short, sampled)]
    with LLM(folder, kv_cache_memory=NUM_BLOCKS * BLOCK_BYTES_ONE_RANK * v * (1 + draft_blocks * t * p) // (t * p),
             block_size=BLOCK, tensor_parallel_size=t, pipeline_parallel_size=p, virtual_engines=v,
             speculative_config=speculative, admission_headroom=0.0) as llm:  # admit what fits: preemption happens
        assert [w.num_blocks for w in llm.stats().workers] == [NUM_BLOCKS] * v
        assert [_tokens(llm, prompts) for _ in range(2)] == reference
        greedy = llm.stats()
        drafted, accepted = greedy.spec_decode.num_draft_tokens, greedy.spec_decode.num_accepted_tokens
        assert 0 < accepted <= drafted and greedy.num_preemptions > 0
        assert (accepted == drafted) == (method == "self_draft"), (accepted, drafted)
        assert [r.token_ids for r in llm.generate(short, sampled)] == want_sampled
        stats = llm.stats()
        assert stats.spec_decode.num_draft_tokens > greedy.spec_decode.num_draft_tokens
        assert all(w.num_free_blocks == w.num_blocks and w.num_running == 0 for w in stats.workers)


def test_pipeline_drafts_follow_the_target_through_swap_preemption(tiny, reference):
    """Swap-out and swap-in move the first stage's draft K/V with the target's (the same block ids): the
    model as its own draft still has every draft accepted, and greedy tokens stay one rank's."""
    folder, prompts = tiny
    speculative = {**NGRAM, "method": "draft_model", "model": str(folder)}
    per_rank_block = BLOCK_BYTES_ONE_RANK * 3 // 2  # half the layers of one rank's block, and the whole draft's
    with LLM(folder, kv_cache_memory=2 * NUM_BLOCKS * per_rank_block, swap_space=128 * per_rank_block,
             block_size=BLOCK, pipeline_parallel_size=2, preemption_mode="swap", speculative_config=speculative,
             admission_headroom=0.0) as llm:  # two virtual engines, half of each rank's budget each
        assert _tokens(llm, prompts) == reference[0]
        stats = llm.stats()
        assert stats.num_swap_preemptions > 0 and [w.num_blocks for w in stats.workers] == [NUM_BLOCKS] * 2
        assert 0 < stats.spec_decode.num_accepted_tokens == stats.spec_decode.num_draft_tokens
