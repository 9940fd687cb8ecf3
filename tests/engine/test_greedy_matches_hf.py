"""The in-process engine's greedy output is Hugging Face's greedy output on each prompt alone:
submitted together, arriving staggered, and under a KV cache so small that preemption happens, with
the default GEMMs (on CPU pagedserve's panel GEMM or oneDNN: models/onednn.resolve_gemm_backend); and
with each GEMM backend named: the reference (``--gemm-backend torch``, transformers' own F.linear),
``onednn`` and ``panels``. None is bit-identical to HF's logits (MKL's rows change with the
batch's row count too: scripts/gemm_batch_invariance.py), so equality is on these prompts. HF's greedy
output is checked by teacher forcing (``HfGreedyCheck``: one HF forward per output), which
``test_teacher_forcing_agrees_with_hf_generate`` ties to HF's ``generate`` (and the penalties test
under a logits processor)."""

from __future__ import annotations

import pytest

from pagedserve.llm import LLM
from pagedserve.engine.models.panel_gemm import panels_available
from pagedserve.engine.sampling_params import SamplingParams
from tests.engine.conftest import BASE_PROMPTS, HfGreedyCheck, hf_greedy

pytestmark = pytest.mark.model

MAX_TOKENS = 24
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
BLOCK_BYTES = 2 * 30 * 16 * 3 * 64 * 4  # one 16-token block of the default model, float32


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[list[int]]:
    ids = [tokenizer.encode_prompt(p) for p in BASE_PROMPTS]
    assert len(ids) >= 16 and len({len(i) for i in ids}) >= 10, "prompts of different lengths"
    return ids


def assert_hf_greedy(check: HfGreedyCheck, prompt_ids: list[list[int]], outputs: dict[int, list[int]]) -> None:
    """Every prompt's output is HF's greedy output of MAX_TOKENS tokens (or up to EOS)."""
    assert sorted(outputs) == list(range(len(prompt_ids)))
    for i, ids in enumerate(prompt_ids):
        differs = check.first_difference(ids, outputs[i], MAX_TOKENS)
        assert differs is None, f"prompt {i} ({BASE_PROMPTS[i][:40]!r}): output id {differs} is not HF's greedy choice"


def test_teacher_forcing_agrees_with_hf_generate(hf_model, hf_greedy_check, prompt_ids):
    """The check the other tests use gives HF generate's own output (generate costs 2-8 s a prompt): on a
    prompt HF answers at length and on one it ends with EOS; a truncated, altered or extended output fails."""
    long, ends = hf_greedy(hf_model, prompt_ids[3], MAX_TOKENS), hf_greedy(hf_model, prompt_ids[2], MAX_TOKENS)
    assert len(long) == MAX_TOKENS and ends[-1] == 2 and len(ends) < MAX_TOKENS
    assert hf_greedy_check.first_difference(prompt_ids[3], long, MAX_TOKENS) is None
    assert hf_greedy_check.first_difference(prompt_ids[2], ends, MAX_TOKENS) is None
    assert hf_greedy_check.first_difference(prompt_ids[3], long[:-1], MAX_TOKENS) == len(long) - 1
    wrong = long[:5] + [(long[5] + 1) % 49152] + long[6:]
    assert hf_greedy_check.first_difference(prompt_ids[3], wrong, MAX_TOKENS) == 5
    assert hf_greedy_check.first_difference(prompt_ids[2], ends + [5], MAX_TOKENS) == len(ends)


def run_staggered(llm: LLM, prompt_ids: list[list[int]], every: int,
                  params: SamplingParams = GREEDY) -> dict[int, list[int]]:
    """Adds one request every ``every`` steps; returns the generated ids by prompt index."""
    outputs: dict[int, list[int]] = {}
    ids_by_request: dict[str, int] = {}
    pending = list(enumerate(prompt_ids))
    step = 0
    while pending or llm.has_unfinished_requests():
        if pending and step % every == 0:
            index, ids = pending.pop(0)
            ids_by_request[llm.add_request(ids, params)] = index
        for item in llm.step():
            outputs.setdefault(ids_by_request[item.request_id], []).extend(item.delta.token_ids)
        step += 1
    return outputs


def test_batch_submitted_together_matches_hf(default_model, prompt_ids, hf_greedy_check):
    llm = LLM(default_model, kv_cache_memory="64MiB")
    results = llm.generate(prompt_ids, GREEDY)
    assert_hf_greedy(hf_greedy_check, prompt_ids, {i: list(r.token_ids) for i, r in enumerate(results)})
    assert llm.stats().num_preemptions == 0
    assert all(w.num_free_blocks == w.num_blocks for w in llm.stats().workers)


def test_staggered_arrivals_match_hf(default_model, prompt_ids, hf_greedy_check):
    llm = LLM(default_model, kv_cache_memory="64MiB", max_num_batched_tokens=256, max_num_seqs=8)
    assert_hf_greedy(hf_greedy_check, prompt_ids, run_staggered(llm, prompt_ids, every=2))


def test_preemption_under_a_small_kv_cache_keeps_outputs_exact(default_model, prompt_ids, hf_greedy_check):
    longest = max(len(ids) for ids in prompt_ids) + MAX_TOKENS
    num_blocks = -(-longest // 16) + 4  # room for the longest request and a little more
    llm = LLM(default_model, kv_cache_memory=num_blocks * BLOCK_BYTES, max_num_seqs=16)
    assert llm.stats().workers[0].num_blocks == num_blocks
    outputs = run_staggered(llm, prompt_ids, every=1)
    assert llm.stats().num_preemptions > 0, "the cache was meant to be too small for all requests"
    assert_hf_greedy(hf_greedy_check, prompt_ids, outputs)
    assert all(w.num_free_blocks == w.num_blocks for w in llm.stats().workers)


@pytest.mark.parametrize("gemm", ["torch", "onednn", "panels"])
def test_each_gemm_backend_matches_hf(default_model, prompt_ids, hf_greedy_check, gemm):
    if gemm == "panels" and not panels_available():
        pytest.skip("the panel GEMM needs an x86 CPU with AVX2 and FMA and a C++ compiler")
    llm = LLM(default_model, kv_cache_memory="64MiB", gemm_backend=gemm)
    results = llm.generate(prompt_ids, GREEDY)
    assert_hf_greedy(hf_greedy_check, prompt_ids, {i: list(r.token_ids) for i, r in enumerate(results)})
