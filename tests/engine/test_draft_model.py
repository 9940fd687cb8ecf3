"""Speculative decoding with a draft model: on the real model, greedy outputs are token-identical to plain
decoding with a random draft (alone and batched); with the target as its own draft every draft is accepted:
its K/V follow the target's through batches, shorter lookaheads near max_tokens, recompute and swap
preemption, prefix hits and forks (n = 2). Seeded samples repeat, logprobs are plain decoding's, every block
is free at the end; the KV budget holds both caches, and a draft of another vocabulary is refused. The tests
of a target drafting for itself, and of a draft that disagrees, run on the small random-weight model
(``small_model``, with another one as the disagreeing draft): what they check holds for any model, and the
default model drafting for itself took 80 s of the suite."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest

from pagedserve.engine.runner_factory import build_model_runner
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.engine.spec_decode.config import SpeculativeConfig
from pagedserve.engine.spec_decode.counters import SpecDecodeCounters
from pagedserve.llm import LLM
from tests.engine.conftest import BASE_PROMPTS
from tests.conftest import SMALL_BLOCK_BYTES, save_small_model
from tests.engine.test_speculative_decoding import COPY_PROMPT, GREEDY, assert_all_free, token_ids

pytestmark = pytest.mark.model



def draft_model(folder) -> dict:
    return {"method": "draft_model", "control": "fixed", "model": str(folder), "num_speculative_tokens": 4}


def assert_every_draft_accepted(before: SpecDecodeCounters, after: SpecDecodeCounters) -> None:
    drafted = after.num_draft_tokens - before.num_draft_tokens
    assert drafted > 0 and after.num_accepted_tokens - before.num_accepted_tokens == drafted, (before, after)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return [tokenizer.encode_prompt(p) for p in BASE_PROMPTS[:6]] + [tokenizer.encode_prompt(COPY_PROMPT)]


@pytest.fixture(scope="module")
def plain_outputs(default_llm, prompts) -> list[tuple[int, ...]]:
    return token_ids(default_llm, prompts)


@pytest.fixture(scope="module")
def small_plain_outputs(small_llm, prompts) -> list[tuple[int, ...]]:
    return token_ids(small_llm, prompts)


@pytest.fixture(scope="module")
def random_draft(default_model, small_model) -> LLM:
    """The real model with a random draft."""
    return LLM(default_model, kv_cache_memory="64MiB", speculative_config=draft_model(small_model))


@pytest.fixture(scope="module")
def disagreeing_draft(small_model, default_model, tmp_path_factory) -> LLM:
    """The small model with another random small model as its draft."""
    other = save_small_model(tmp_path_factory.mktemp("other-small-model"), default_model, seed=12)
    return LLM(small_model, kv_cache_memory="64MiB", speculative_config=draft_model(other))


@pytest.fixture(scope="module")
def self_draft(small_model) -> LLM:
    """The small model as its own draft."""
    return LLM(small_model, kv_cache_memory="64MiB", speculative_config=draft_model(small_model))


def test_greedy_with_a_random_draft_is_plain_decoding_alone_and_batched(random_draft, prompts, plain_outputs):
    for i in (0, 3, 6):
        assert token_ids(random_draft, prompts[i]) == [plain_outputs[i]], i
    assert token_ids(random_draft, prompts) == plain_outputs
    assert random_draft.stats().spec_decode.num_draft_tokens > 0
    assert_all_free(random_draft)


def test_the_target_as_its_own_draft_has_every_draft_accepted(self_draft, prompts, small_plain_outputs):
    before = self_draft.stats().spec_decode
    assert token_ids(self_draft, prompts[1]) == [small_plain_outputs[1]]
    assert token_ids(self_draft, prompts) == small_plain_outputs
    after = self_draft.stats().spec_decode
    assert_every_draft_accepted(before, after)
    assert after.num_accepted_tokens - before.num_accepted_tokens >= 4 * len(prompts)
    assert_all_free(self_draft)


def test_sequences_near_max_tokens_draft_fewer_tokens_in_the_same_batch(self_draft, small_llm, prompts):
    # each sequence drafts 4, 4, then max_tokens - 12 tokens (1 + 5 + 5 emitted before): the third
    # step's draft forwards lose a row after each draft index
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (13, 14, 15, 16)]
    before = self_draft.stats().spec_decode
    assert token_ids(self_draft, prompts[:4], params) == token_ids(small_llm, prompts[:4], params)
    after = self_draft.stats().spec_decode
    assert_every_draft_accepted(before, after)
    per_pos = [a - b for a, b in zip(after.num_accepted_tokens_per_pos, before.num_accepted_tokens_per_pos)]
    assert per_pos == [12, 11, 10, 9]
    assert_all_free(self_draft)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_drafts_follow_the_target_through_preemption(small_model, prompts, small_plain_outputs, mode):
    longest = max(len(p) for p in prompts) + GREEDY.max_tokens
    blocks = -(-longest // 16) + 3
    llm = LLM(small_model, kv_cache_memory=blocks * 2 * SMALL_BLOCK_BYTES, swap_space=64 * 2 * SMALL_BLOCK_BYTES,
              preemption_mode=mode, speculative_config=draft_model(small_model))
    assert token_ids(llm, prompts) == small_plain_outputs
    stats = llm.stats()
    assert stats.workers[0].num_blocks == blocks
    assert stats.num_preemptions > 0 and (stats.num_swap_preemptions > 0) == (mode == "swap")
    assert_every_draft_accepted(SpecDecodeCounters(), stats.spec_decode)
    assert_all_free(llm)


def test_drafts_follow_the_target_after_a_prefix_hit_and_with_two_samples(self_draft, small_llm, prompts,
                                                                         small_plain_outputs):
    copy, before = prompts[-1], self_draft.stats()
    assert token_ids(self_draft, copy) == [small_plain_outputs[-1]]
    assert token_ids(self_draft, copy) == [small_plain_outputs[-1]]  # its prompt's full blocks are cached now
    extended = copy + list(small_plain_outputs[-1])  # hits blocks its output filled through verification steps
    assert token_ids(self_draft, extended) == token_ids(small_llm, extended)
    hits = self_draft.stats().prefix_cache_hits - before.prefix_cache_hits
    assert hits >= (len(copy) - 1) // 16 * 16 + (len(extended) - 1) // 16 * 16
    result = self_draft.generate(prompts[2], SamplingParams(max_tokens=16, temperature=0.0, n=2))[0]
    assert [s.token_ids for s in result.samples] == [small_plain_outputs[2]] * 2
    assert_every_draft_accepted(before.spec_decode, self_draft.stats().spec_decode)
    assert_all_free(self_draft)


def test_seeded_samples_repeat_per_seed(disagreeing_draft, prompts):
    def sample(seed: int) -> list[tuple[int, ...]]:
        return token_ids(disagreeing_draft, prompts[-3:], SamplingParams(max_tokens=16, temperature=1.0, seed=seed,
                                                                    ignore_eos=True))

    first = sample(7)
    assert sample(7) == first and sample(8) != first
    assert_all_free(disagreeing_draft)


SAMPLED = SamplingParams(max_tokens=24, temperature=0.8, top_k=40, top_p=0.9, min_p=0.02, repetition_penalty=1.3,
                         frequency_penalty=0.2, logit_bias={28: 2.0, 30: -5.0}, ignore_eos=True)
"""Sampling with every kind of processing a draft's ``q`` must share with the target's ``p``."""


def test_greedy_drafts_get_the_targets_processing_so_the_target_itself_has_every_one_accepted(
        self_draft, small_llm, prompts):
    # penalties and bias move the target's argmax (checked: the bias of +4 on id 28 moves it at 12-24 of 24
    # positions, +2 at none): drafts from the raw logits would be rejected there
    params = replace(SAMPLED, temperature=0.0, logit_bias={28: 4.0, 30: -5.0})
    processed = token_ids(small_llm, prompts[:4], params)
    assert processed != token_ids(small_llm, prompts[:4], replace(params, repetition_penalty=1.0,
                                                                  frequency_penalty=0.0, logit_bias={}))
    before = self_draft.stats().spec_decode
    assert token_ids(self_draft, prompts[:4], params) == processed
    assert_every_draft_accepted(before, self_draft.stats().spec_decode)
    assert_all_free(self_draft)


def test_sampled_drafts_come_from_the_drafts_distribution_so_the_target_itself_has_every_one_accepted(
        self_draft, disagreeing_draft, prompts):
    # a draft drawn from q is accepted with min(1, p/q): q = p (the same model, processed alike) keeps
    # all of them, where argmax drafts would keep p(argmax) of them and a q processed otherwise
    # (no penalty, no top-k) would lose some
    before = self_draft.stats().spec_decode
    outputs = token_ids(self_draft, prompts[:4], replace(SAMPLED, seed=11))
    after = self_draft.stats().spec_decode
    assert_every_draft_accepted(before, after)
    assert [len(o) for o in outputs] == [24] * 4
    assert after.num_accepted_tokens - before.num_accepted_tokens >= 4 * 16
    assert token_ids(self_draft, prompts[:4], replace(SAMPLED, seed=11)) == outputs  # seeded: the same again
    before = disagreeing_draft.stats().spec_decode  # a draft that disagrees: drafts rejected, still 24 tokens each
    assert [len(o) for o in token_ids(disagreeing_draft, prompts[:4], replace(SAMPLED, seed=11))] == [24] * 4
    after = disagreeing_draft.stats().spec_decode
    assert after.num_accepted_tokens - before.num_accepted_tokens < after.num_draft_tokens - before.num_draft_tokens
    assert_all_free(self_draft)
    assert_all_free(disagreeing_draft)


def test_logprobs_of_accepted_tokens_are_plain_decodings(self_draft, small_llm, tokenizer):
    # a prompt no other test sends: neither engine hits cached blocks of it (a chunk over cached context
    # computes its K/V in another order than a whole prefill, which would move the logprobs by ~1e-5)
    prompt = tokenizer.encode_prompt("Write the numbers from one to twenty in words, separated by commas:")
    params = SamplingParams(max_tokens=16, temperature=0.0, logprobs=3)
    before = self_draft.stats().spec_decode.num_accepted_tokens
    expected = small_llm.generate(prompt, params)[0].samples[0]
    got = self_draft.generate(prompt, params)[0].samples[0]
    assert self_draft.stats().spec_decode.num_accepted_tokens - before >= 8
    assert got.token_ids == expected.token_ids and len(got.logprobs) == len(expected.logprobs) == 16
    for a, b in zip(got.logprobs, expected.logprobs):
        assert (a.token_id, a.rank, a.top_token_ids) == (b.token_id, b.rank, b.top_token_ids)
        assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
        assert a.top_logprobs == pytest.approx(b.top_logprobs, abs=1e-5)


def test_the_kv_budget_holds_both_caches_of_the_same_blocks(small_model):
    runner = build_model_runner(small_model, kv_cache_memory_bytes=100 * SMALL_BLOCK_BYTES + 5,
                                swap_space_bytes=30 * SMALL_BLOCK_BYTES,
                                speculative=SpeculativeConfig(**draft_model(small_model)))
    draft_cache = runner.proposer.kv_cache
    assert (runner.num_blocks, runner.num_cpu_blocks) == (draft_cache.num_blocks, draft_cache.num_cpu_blocks) == (50, 15)


def test_a_draft_of_another_vocabulary_is_refused(small_model, tmp_path):
    from tests.worker.tiny_models import save_tiny_model

    save_tiny_model(tmp_path, "llama")  # a 96-token vocabulary
    with pytest.raises(ValueError, match="vocabulary of 96 tokens, the target 49152"):
        build_model_runner(small_model, kv_cache_memory_bytes=1 << 20,
                           speculative=SpeculativeConfig(method="draft_model", model=str(tmp_path)))


def test_a_draft_of_a_shorter_context_is_refused(small_model, tmp_path):
    # a draft runs over every position of the target's sequences (learned positions fail past theirs)
    shutil.copytree(small_model, tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "config.json").read_text())
    target_len = config["max_position_embeddings"]
    (tmp_path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 64}))
    with pytest.raises(ValueError, match=f"contexts of up to 64 tokens, the target {target_len}: take a draft"):
        build_model_runner(small_model, kv_cache_memory_bytes=1 << 20,
                           speculative=SpeculativeConfig(method="draft_model", model=str(tmp_path)))


@pytest.mark.parametrize("options", [{"method": "draft_model"}, {"method": "ngram", "model": "/some/draft"},
                                     {"method": "none", "model": "/some/draft"}])
def test_draft_model_needs_a_model_and_only_it_takes_one(options):
    with pytest.raises(ValueError, match="draft_model needs a model"):
        SpeculativeConfig(**options)
