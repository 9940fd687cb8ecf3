"""Speculative decoding (n-gram prompt lookup) on the real model: greedy outputs are token-identical
to plain decoding alone, batched, under recompute and swap preemption, after a prefix-cache hit and
with n = 2; logprobs of accepted tokens equal plain decoding's; penalties, min_tokens and stop strings
see the tokens in order; structured outputs speculate with plain decoding's tokens and errors; seeded
sampled outputs repeat per seed; a prompt that repeats its input gets drafts accepted; every KV block is
free at the end."""

from __future__ import annotations

import json

import pytest

from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.engine.structured_output import StructuredOutput, StructureKind
from pagedserve.llm import LLM
from tests.engine.conftest import BASE_PROMPTS
from tests.engine.test_grammar_builds import WIDE, ask, params, run
from tests.engine.test_structured_outputs import PERSON, REGEXES
from tests.engine.test_greedy_matches_hf import BLOCK_BYTES

pytestmark = pytest.mark.model

GREEDY = SamplingParams(max_tokens=16, temperature=0.0)
NGRAM = {"method": "ngram", "control": "fixed", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}
TEXT = ("The lighthouse keeper climbed the stairs every evening, lit the great lamp, and watched the ships pass "
        "safely through the narrow channel between the rocks.")
COPY_PROMPT = f"Repeat this text word for word.\nText: {TEXT}\nRepeated text: {TEXT[:40]}"


def assert_all_free(llm: LLM) -> None:
    for worker in llm.stats().workers:
        assert worker.num_free_blocks == worker.num_blocks and worker.num_running == 0


def token_ids(llm: LLM, prompts, params=GREEDY) -> list[tuple[int, ...]]:
    return [r.token_ids for r in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return [tokenizer.encode_prompt(p) for p in BASE_PROMPTS[:12]] + [tokenizer.encode_prompt(COPY_PROMPT)]


@pytest.fixture(scope="module")
def plain(default_model) -> LLM:
    return LLM(default_model, kv_cache_memory="64MiB")


@pytest.fixture(scope="module")
def plain_outputs(plain, prompts) -> list[tuple[int, ...]]:
    return token_ids(plain, prompts)


@pytest.fixture(scope="module")
def spec(default_model) -> LLM:
    return LLM(default_model, kv_cache_memory="64MiB", speculative_config=NGRAM)


def test_greedy_alone_is_plain_decoding_and_the_copy_prompt_accepts_drafts(default_model, prompts, plain_outputs):
    llm = LLM(default_model, kv_cache_memory="64MiB", speculative_config=NGRAM)
    for i in range(0, len(prompts) - 1, 2):  # half the plain prompts (batch 1 is slow), short to long
        assert token_ids(llm, prompts[i]) == [plain_outputs[i]], i
    before = llm.stats().spec_decode
    assert token_ids(llm, prompts[-1]) == [plain_outputs[-1]]
    assert_all_free(llm)
    after = llm.stats().spec_decode
    assert after.num_drafts > before.num_drafts > 0
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    per_pos = [a - b for a, b in zip(after.num_accepted_tokens_per_pos, before.num_accepted_tokens_per_pos)]
    assert accepted >= 8, (before, after)  # the copy continues the text it was given
    assert per_pos[0] >= per_pos[-1] > 0, per_pos


def test_greedy_batched_is_plain_decoding(spec, prompts, plain_outputs):
    assert token_ids(spec, prompts) == plain_outputs
    assert_all_free(spec)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_under_preemption_is_plain_decoding(default_model, prompts, plain_outputs, mode):
    longest = max(len(p) for p in prompts) + GREEDY.max_tokens
    blocks = -(-longest // 16) + 3
    llm = LLM(default_model, kv_cache_memory=blocks * BLOCK_BYTES, swap_space=64 * BLOCK_BYTES, preemption_mode=mode,
              speculative_config=NGRAM)
    assert token_ids(llm, prompts) == plain_outputs
    stats = llm.stats()
    assert stats.num_preemptions > 0 and (stats.num_swap_preemptions > 0) == (mode == "swap")
    assert stats.spec_decode.num_drafts > 0
    assert_all_free(llm)


def test_greedy_after_a_prefix_hit_is_plain_decoding(default_model, plain, prompts, plain_outputs):
    copy = prompts[-1]
    llm = LLM(default_model, kv_cache_memory="64MiB", speculative_config=NGRAM)
    assert token_ids(llm, copy) == [plain_outputs[-1]]
    assert token_ids(llm, copy) == [plain_outputs[-1]]  # its prompt's full blocks are cached now
    stats = llm.stats()
    assert stats.prefix_cache_hits == (len(copy) - 1) // 16 * 16 > 0 and stats.spec_decode.num_accepted_tokens > 0
    # the blocks its output filled were written by verification steps (rejected drafts' K/V among
    # them, overwritten since): a prompt that continues the output hits them and still decodes exactly
    extended = copy + list(plain_outputs[-1])
    assert token_ids(llm, extended) == token_ids(plain, extended)
    assert llm.stats().prefix_cache_hits - stats.prefix_cache_hits == (len(extended) - 1) // 16 * 16
    assert_all_free(llm)


def test_two_greedy_samples_are_plain_decoding(spec, plain, prompts):
    params = SamplingParams(max_tokens=16, temperature=0.0, n=2)
    for prompt in (prompts[5], prompts[-1]):
        (expected,) = token_ids(plain, prompt)
        result = spec.generate(prompt, params)[0]
        assert [s.token_ids for s in result.samples] == [expected, expected]
    assert_all_free(spec)


def test_logprobs_of_accepted_tokens_are_plain_decodings(spec, plain, prompts):
    params = SamplingParams(max_tokens=16, temperature=0.0, logprobs=3)
    before = spec.stats().spec_decode.num_accepted_tokens
    expected, got = plain.generate(prompts[-1], params)[0].samples[0], spec.generate(prompts[-1], params)[0].samples[0]
    assert spec.stats().spec_decode.num_accepted_tokens > before
    assert got.token_ids == expected.token_ids and len(got.logprobs) == len(expected.logprobs) == 16
    for a, b in zip(got.logprobs, expected.logprobs):
        assert (a.token_id, a.rank, a.top_token_ids) == (b.token_id, b.rank, b.top_token_ids)
        assert (a.logprob, a.top_logprobs) == (b.logprob, b.top_logprobs)  # verification rows attend as decodes


def test_penalties_min_tokens_and_stop_strings_see_tokens_in_order(spec, plain, prompts, tokenizer):
    (copied,) = plain.generate(prompts[-1], SamplingParams(max_tokens=16, temperature=0.0))
    stop = copied.samples[0].text[12:18]  # a stop string inside what the copy emits
    for params in (SamplingParams(max_tokens=16, temperature=0.0, repetition_penalty=1.2, frequency_penalty=0.3,
                                  presence_penalty=0.2, min_tokens=4, logit_bias={11: 2.0}),
                   SamplingParams(max_tokens=16, temperature=0.0, stop=[stop])):
        expected = [s.samples[0] for s in plain.generate(prompts[-4:], params)]
        got = [s.samples[0] for s in spec.generate(prompts[-4:], params)]
        assert [(s.token_ids, s.text, s.finish_reason, s.stop_reason) for s in got] == \
               [(s.token_ids, s.text, s.finish_reason, s.stop_reason) for s in expected]
    assert expected[-1].stop_reason == stop
    assert_all_free(spec)


def test_structured_outputs_speculate_with_plain_decodings_tokens_and_errors(spec, plain, tokenizer):
    """Each draft is verified under the grammar's mask after the drafts before it: in one batch, a JSON copy
    (drafts accepted), a JSON answer, a regex and a schema past llguidance's parser limit give plain
    decoding's tokens and the same error."""
    record = json.dumps({"name": "Ada Lovelace", "age": 36, "color": "green", "tags": ["math", "poetry"]})
    person = params(StructuredOutput(StructureKind.JSON, json.dumps(PERSON)), 60)
    requests = [(ask(tokenizer, f"Copy this JSON exactly: {record}"), person),
                (ask(tokenizer, f"Here is a record: {record}. Give another person like it as JSON."), person),
                (ask(tokenizer, "Write an email address."), params(StructuredOutput(StructureKind.REGEX,
                                                                                    REGEXES["email"]), 20)),
                (ask(tokenizer, "Fill the form as JSON."), params(StructuredOutput(StructureKind.JSON,
                                                                                   json.dumps(WIDE)), 30))]
    before = spec.stats().spec_decode.num_accepted_tokens
    got = list(run(spec, requests).values())
    assert spec.stats().spec_decode.num_accepted_tokens - before >= 10
    assert got == list(run(plain, requests).values())
    assert json.loads(tokenizer.decode(got[0][0], True)) == json.loads(record)
    assert got[3][1] is not None and "max is 2000" in got[3][1], got[3]
    assert_all_free(spec)


def test_a_forms_keys_are_drafted_and_accepted_with_nothing_to_copy(spec, plain, tokenizer):
    """The grammar forces each required key after the value before it: drafted (nothing in the prompt to look
    up) and accepted, with plain decoding's tokens."""
    keys = ["first_name", "last_name", "home_city", "favorite_color", "zodiac_sign", "job_title"]
    form = {"type": "object", "additionalProperties": False, "required": keys,
            "properties": {key: {"type": "string", "maxLength": 12} for key in keys}}
    request = [(ask(tokenizer, "Fill in the sign-up form for Ada Lovelace as JSON."),
                params(StructuredOutput(StructureKind.JSON, json.dumps(form)), 80))]
    before = spec.stats().spec_decode.num_accepted_tokens
    (got,) = run(spec, request).values()
    assert spec.stats().spec_decode.num_accepted_tokens - before >= 2 * len(keys)
    assert [got] == list(run(plain, request).values())
    assert list(json.loads(tokenizer.decode(got[0], True))) == keys


def test_seeded_samples_repeat_per_seed(spec, prompts):
    def sample(seed: int) -> list[tuple[int, ...]]:
        params = SamplingParams(max_tokens=16, temperature=1.0, seed=seed, ignore_eos=True)
        return token_ids(spec, prompts[-3:], params)

    first = sample(7)
    assert sample(7) == first and sample(8) != first
    assert_all_free(spec)
