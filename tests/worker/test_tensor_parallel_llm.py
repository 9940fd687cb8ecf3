"""``LLM(tensor_parallel_size=2)``: greedy tokens equal TP=1 (prefix caching, preemption, speculation, a
structured output's drafts); a dead or stuck helper rank makes the step raise within a bound instead of
hanging."""

from __future__ import annotations

import pytest

from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.engine.structured_output import StructuredOutput, StructureKind
from pagedserve.llm import LLM
from pagedserve.text.tokenizer import PromptTokenizer
from tests.conftest import save_small_model
from tests.worker.tp_helpers import (BLOCK, BLOCK_BYTES_ONE_RANK as BLOCK_BYTES_TP1, NUM_BLOCKS,
                                     assert_a_dead_or_stuck_rank_fails_the_step,
                                     assert_seeded_sampling_equal_one_rank, generated_tokens as _tokens,
                                     tiny_model_and_prompts)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model_and_prompts(tmp_path_factory.mktemp("tp"), (1, 4, 7, 13, 20, 31, 5, 9, 26, 2))


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
        assert_a_dead_or_stuck_rank_fails_the_step(llm, runner, helper.pid, how, prompts[:2])
    finally:
        llm.close()


def test_tp2_seeded_sampling_n2_and_logprobs_equal_tp1(tiny):
    """The sampler runs on rank 0 with the same per-request seeds as one rank."""
    folder, prompts = tiny
    assert_seeded_sampling_equal_one_rank(folder, prompts[:4], tensor_parallel_size=2)


NGRAM = {"method": "ngram", "control": "fixed", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_tp2_speculation_gives_plain_greedy_tokens_and_one_ranks_seeded_samples(tiny, method):
    """Rank 0 drafts (n-gram, or the whole model as its own draft beside its shard) and verifies; the
    other rank runs the same rows: greedy tokens are plain decoding's, seeded samples one rank's, and
    the draft's cache costs every rank the same blocks."""
    folder, prompts = tiny
    speculative = NGRAM if method == "ngram" else {"method": "draft_model", "model": str(folder),
                                                   "num_speculative_tokens": 3}
    # a block of the draft's cache (both KV heads) beside each block of a rank's 1 head, or of one rank's 2
    heads_per_block, one_rank_heads = (1, 2) if method == "ngram" else (3, 4)
    sampled = SamplingParams(max_tokens=12, temperature=1.0, seed=5, ignore_eos=True)
    plain = LLM(folder, kv_cache_memory=NUM_BLOCKS * BLOCK_BYTES_TP1, block_size=BLOCK)
    one_rank = LLM(folder, kv_cache_memory=NUM_BLOCKS * BLOCK_BYTES_TP1 * one_rank_heads // 2, block_size=BLOCK,
                   speculative_config=speculative)
    # which positions a sampled sequence drafts decides which uniform draws its token: the sampled prompts
    # are short enough that no lookahead is dropped for want of blocks, so both engines draft alike
    short = [p for p in prompts if len(p) <= 7]
    want_greedy, want_sampled = _tokens(plain, prompts), [r.token_ids for r in one_rank.generate(short, sampled)]
    with LLM(folder, kv_cache_memory=NUM_BLOCKS * BLOCK_BYTES_TP1 * heads_per_block // 2, block_size=BLOCK,
             tensor_parallel_size=2, speculative_config=speculative) as llm:
        assert llm.stats().workers[0].num_blocks == one_rank.stats().workers[0].num_blocks == NUM_BLOCKS
        assert _tokens(llm, prompts) == want_greedy
        greedy = llm.stats().spec_decode
        assert greedy.num_accepted_tokens > 0
        assert [r.token_ids for r in llm.generate(short, sampled)] == want_sampled
        stats = llm.stats()
        assert stats.spec_decode.num_draft_tokens > greedy.num_draft_tokens
        assert stats.workers[0].num_free_blocks == NUM_BLOCKS and stats.workers[0].num_running == 0


@pytest.mark.model  # its tokenizer
def test_tp2_speculation_on_a_structured_output_gives_plain_greedy_tokens(tmp_path, default_model):
    """Rank 0 masks each draft and each verification row by the grammar after the drafts before it (its
    matcher; the other rank has none): a random model that drafts for itself under the regex's masks has
    every draft kept (unmasked, it had drafts the regex refuses), and its tokens are one rank's without
    speculation."""
    folder = save_small_model(tmp_path / "small", default_model)
    tokenizer = PromptTokenizer.from_folder(folder)
    prompts = [tokenizer.encode_prompt(p) for p in ("aaa bbb aaa bbb", "hello world hello", "x y z x y z")]
    params = SamplingParams(max_tokens=60, temperature=0.0,
                            structured_output=StructuredOutput(StructureKind.REGEX, "[a-z ]{4,400}"))
    want = [r.token_ids for r in LLM(folder, kv_cache_memory="16MiB").generate(prompts, params)]
    draft = {"method": "draft_model", "model": str(folder), "num_speculative_tokens": 3, "control": "fixed"}
    with LLM(folder, kv_cache_memory="16MiB", tensor_parallel_size=2, speculative_config=draft) as llm:
        assert [r.token_ids for r in llm.generate(prompts, params)] == want
        stats = llm.stats().spec_decode
        assert stats.num_accepted_tokens == stats.num_draft_tokens > 0
