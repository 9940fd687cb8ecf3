"""Greedy outputs are the same with and without each KV-memory feature: prefix caching, chunked prefill,
swap and recompute preemption, all together with staggered arrivals; and n=4 samples share their prompt's
blocks. On the small random-weight model (``small_model``: nearly every id it generates differs, so a
feature that moved one position's K/V changes what follows): these check that two paths of the engine agree,
which holds for any model. The default model against transformers (batched, staggered, preempted under a small
cache) is tests/engine/test_greedy_matches_hf.py's."""

from __future__ import annotations

import pytest

from pagedserve.llm import LLM
from pagedserve.engine.messages import SequenceId
from pagedserve.engine.sampling_params import SamplingParams
from tests.engine.conftest import BASE_PROMPTS
from tests.conftest import SMALL_BLOCK_BYTES
from tests.engine.test_greedy_matches_hf import run_staggered
from tests.markers import needs_prefill_op

pytestmark = pytest.mark.model

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return [tokenizer.encode_prompt(p) for p in BASE_PROMPTS[:12]]


@pytest.fixture(scope="module")
def plain_outputs(small_model, prompts) -> list[tuple[int, ...]]:
    """No feature at all: whole prompts, no caching, a cache big enough for everyone."""
    llm = LLM(small_model, kv_cache_memory="64MiB", enable_prefix_caching=False, enable_chunked_prefill=False)
    return [r.token_ids for r in llm.generate(prompts, GREEDY)]


def test_shared_1000_token_system_prompt_with_prefix_caching(small_model, tokenizer):
    system = tokenizer.encode_prompt(" ".join(f"Rule {i}: be brief, exact and kind." for i in range(90)))[:1000]
    assert len(system) == 1000
    # Two questions (three took 16 s more and showed nothing a second hit does not): the uncached reference
    # prefills the later 1000+-token prompt whole.
    questions = [tokenizer.encode_prompt(f" Question {i}: what is {i} plus {i}?") for i in range(2)]
    prompts = [system + q for q in questions]
    params = SamplingParams(max_tokens=6, temperature=0.0)
    cached = LLM(small_model, kv_cache_memory="128MiB")
    with_cache = []
    for p in prompts:  # one after another, so each later request finds the system prompt cached
        with_cache.append(cached.generate(p, params)[0].token_ids)
        if len(with_cache) == 1:
            assert cached.stats().prefix_cache_hits == 0  # the first is its own uncached reference
    stats = cached.stats()
    assert stats.prefix_cache_hits >= 992  # 62 full blocks of the system prompt, for the later request
    # The first request found nothing cached: only the later one needs an uncached reference.
    uncached = LLM(small_model, kv_cache_memory="128MiB", enable_prefix_caching=False)
    assert uncached.generate(prompts[1], params)[0].token_ids == with_cache[1]
    assert uncached.stats().prefix_cache_hits == 0


@pytest.mark.parametrize("budget", [7, 16, 64])
def test_chunked_prefill_budgets(small_model, prompts, plain_outputs, budget):
    llm = LLM(small_model, kv_cache_memory="64MiB", max_num_batched_tokens=budget, max_num_seqs=budget,
              enable_prefix_caching=False)
    assert [r.token_ids for r in llm.generate(prompts, GREEDY)] == plain_outputs


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_modes_under_a_small_cache(small_model, prompts, plain_outputs, mode):
    longest = max(len(p) for p in prompts) + GREEDY.max_tokens
    blocks = -(-longest // 16) + 3
    llm = LLM(small_model, kv_cache_memory=blocks * SMALL_BLOCK_BYTES, swap_space=64 * SMALL_BLOCK_BYTES,
              preemption_mode=mode, enable_prefix_caching=False)
    assert [r.token_ids for r in llm.generate(prompts, GREEDY)] == plain_outputs
    stats = llm.stats()
    assert stats.num_preemptions > 0
    assert (stats.num_swap_preemptions > 0) == (mode == "swap")


def test_all_features_together_with_staggered_arrivals(small_model, small_llm, tokenizer, prompts, plain_outputs):
    long = tokenizer.encode_prompt(BASE_PROMPTS[15])  # ~130 tokens: 8 full blocks to share
    long_alone = small_llm.generate(long, GREEDY)[0]  # alone in its batch
    llm = LLM(small_model, kv_cache_memory=(-(-(len(long) + 12) // 16)) * SMALL_BLOCK_BYTES,
              swap_space=64 * SMALL_BLOCK_BYTES,
              preemption_mode="swap", max_num_batched_tokens=48, max_num_seqs=16, policy="priority")
    outputs = run_staggered(llm, [long, long, *prompts], every=1, params=GREEDY)
    assert [tuple(outputs[i + 2]) for i in range(len(prompts))] == plain_outputs
    assert tuple(outputs[0]) == tuple(outputs[1]) == long_alone.token_ids
    stats = llm.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0


@needs_prefill_op
def test_chunked_and_cached_prefills_give_the_bits_of_a_whole_prefill(small_model):
    """With the prefill op a query row's attention sums run over the same key blocks in the same order
    however its prompt is split (tests/worker/test_prefill_attention_cpu.py), and the panel GEMMs are
    batch-invariant: 16-token chunks, or a prompt whose first 256 tokens are cached, give the logprobs of
    the whole prompt at once, bit for bit (torch's SDPA kernel: 2.7e-5 apart)."""
    shared = [(13 * j) % 40000 + 100 for j in range(256)]
    prompts = [shared + [(7 * i + 5 * j) % 30000 + 200 for j in range(40 + i)] for i in range(2)]
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=3)
    whole = LLM(small_model, kv_cache_memory="64MiB", enable_prefix_caching=False, max_num_batched_tokens=2048)
    want = [r.samples for r in whole.generate(prompts, params)]
    chunked = LLM(small_model, kv_cache_memory="64MiB", max_num_batched_tokens=16)
    got = [chunked.generate(p, params)[0].samples for p in prompts]  # the second finds the first's blocks
    assert chunked.stats().prefix_cache_hits == 256
    assert got == want


@needs_prefill_op
def test_a_prompts_last_token_after_a_prefix_hit_gives_the_bits_of_the_whole_prompt(small_model):
    """A prompt of 257 tokens whose first 256 are cached computes one token: a prompt row, so the prefill
    op's (as in the whole prompt), not the decode op's (``attention_layout``)."""
    shared = [(13 * j) % 40000 + 100 for j in range(256)]
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=3)
    whole = LLM(small_model, kv_cache_memory="64MiB", enable_prefix_caching=False, max_num_batched_tokens=2048)
    want = whole.generate(shared + [777], params)[0].samples  # in one chunk
    cached = LLM(small_model, kv_cache_memory="64MiB")
    cached.generate(shared + [555, 556], SamplingParams(max_tokens=1, temperature=0.0))
    got = cached.generate(shared + [777], params)[0].samples
    assert cached.stats().prefix_cache_hits == 256
    assert got == want


@needs_prefill_op
def test_outputs_recomputed_after_preemption_keep_the_bits_of_an_uninterrupted_run(small_model, prompts):
    """A recompute preemption computes a sequence's prompt and outputs again in one prefill: the outputs'
    rows go to the decode op as one-token sequences (``attention_layout``), as plain decoding computed
    them, so every logprob after the preemption is the uninterrupted run's, bit for bit. Through the
    prefill op the recomputed outputs moved the logprobs that follow by up to ~1.5e-5."""
    params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=3, ignore_eos=True)
    roomy = LLM(small_model, kv_cache_memory="64MiB", enable_prefix_caching=False)
    want = [r.samples for r in roomy.generate(prompts, params)]
    longest = max(len(p) for p in prompts) + params.max_tokens
    tight = LLM(small_model, kv_cache_memory=(-(-longest // 16) + 3) * SMALL_BLOCK_BYTES, preemption_mode="recompute",
                enable_prefix_caching=False)
    got = [r.samples for r in tight.generate(prompts, params)]
    assert tight.stats().num_preemptions > 0
    assert got == want


@needs_prefill_op
def test_a_next_turn_holding_an_earlier_answer_gets_the_bits_of_a_fresh_prefill_with_own_outputs(small_model):
    """A chat's next turn is the last prompt, its answer and a new message. The answer's K/V were computed by
    the decode op and a fresh prompt's are by the prefill op (sums ~1e-5 apart). Shared (the default), the
    turn hits the answer's blocks: its logprobs depend on whether they are still cached. With
    ``prefix_cache_outputs="own"`` blocks past a prompt are keyed by its length too
    (``block_hash.hash_full_blocks``): the turn finds the first prompt's blocks only, prefills the answer
    again, and gets the bits of an engine without prefix caching."""
    first = [(13 * j) % 40000 + 100 for j in range(64)]
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=3, ignore_eos=True)
    got, hits = {}, {}
    for outputs in ("shared", "own"):
        cached = LLM(small_model, kv_cache_memory="64MiB", prefix_cache_outputs=outputs)
        answer = cached.generate(first, SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True))[0].samples[0]
        turn = first + list(answer.token_ids) + [(7 * j) % 30000 + 200 for j in range(20)]
        got[outputs], hits[outputs] = cached.generate(turn, params)[0].samples, cached.stats().prefix_cache_hits
    assert hits == {"shared": 96, "own": 64}  # the prompt's 4 blocks and the answer's 2 full ones; the prompt's
    fresh = LLM(small_model, kv_cache_memory="64MiB", enable_prefix_caching=False).generate(turn, params)[0].samples
    assert got["own"] == fresh and got["shared"] != fresh


def test_four_seeded_samples_share_the_prompt_blocks(small_model, small_llm, tokenizer):
    llm = LLM(small_model, kv_cache_memory="64MiB", enable_prefix_caching=False)
    prompt = tokenizer.encode_prompt("A lighthouse keeper lives alone on a rock far out at sea. One night a storm "
                                     "comes, and a small boat appears in the beam. Write one line of what happens next:")
    assert len(prompt) > 32  # two full blocks to share, and a partial one to copy
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=2024, n=4, ignore_eos=True)
    request_id = llm.add_request(prompt, params)
    peak_used = 0
    first_block_refs = 0
    while llm.has_unfinished_requests():
        llm.step()
        stats = llm.stats().workers[0]
        peak_used = max(peak_used, stats.num_blocks - stats.num_free_blocks)
        table = llm.engine.scheduler.block_manager("worker-0").block_table(SequenceId(request_id))
        if table:
            first_block_refs = max(first_block_refs, llm.engine.scheduler.block_manager("worker-0").ref_count(table[0]))
    assert first_block_refs == 4  # the prompt's full blocks are held by all four samples
    independent = -(-(len(prompt) + 16) // 16) * 4
    assert peak_used < independent
    result = llm.generate(prompt, params)[0]
    samples = [s.token_ids for s in result.samples]
    assert len(samples) == 4 and len(set(samples)) == 4  # four different samples
    again = small_llm.generate(prompt, params)[0]  # another engine, with a history of its own
    assert [s.token_ids for s in again.samples] == samples  # reproducible with the seed
