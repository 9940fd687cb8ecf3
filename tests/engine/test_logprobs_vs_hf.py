"""Logprobs and prompt logprobs of the default model (float32) equal Hugging Face's
``log_softmax(logits / temperature)`` within 1e-4: chosen token, rank and top-k alternatives,
alone and batched with requests that ask for none; prompt logprobs over chunked prefills and
with prefix caching on."""

from __future__ import annotations

import pytest
import torch

from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.llm import LLM
from tests.engine.conftest import BASE_PROMPTS

pytestmark = pytest.mark.model

TOL = 1e-4


@pytest.fixture(scope="module")
def llm(default_model):
    return LLM(default_model, kv_cache_memory="64MiB", max_num_batched_tokens=32)


def hf_logprobs(hf_model, ids: list[int], temperature: float = 1.0) -> torch.Tensor:
    """float32 ``[len(ids), V]``: log_softmax of HF's logits at each position (predicting the next)."""
    with torch.inference_mode():
        logits = hf_model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits / temperature, dim=-1)


def assert_entry_matches(entry, reference: torch.Tensor, token_id: int, k: int) -> None:
    """One TokenLogprobs against a reference log-distribution ``[V]``."""
    assert entry.token_id == token_id
    assert abs(entry.logprob - float(reference[token_id])) < TOL
    low = int((reference > reference[token_id] + 1e-5).sum()) + 1
    high = int((reference >= reference[token_id] - 1e-5).sum())
    assert low <= entry.rank <= high
    values, ids = reference.topk(k)
    assert len(entry.top_token_ids) == k
    for got, want in zip(entry.top_logprobs, values.tolist()):
        assert abs(got - want) < TOL
    if k:
        # ids equal, except that alternatives tying within 1e-6 may come in any order
        kth = float(values[-1])
        sure = {i for i, v in zip(ids.tolist(), values.tolist()) if v > kth + 1e-6}
        assert sure <= set(entry.top_token_ids)
        for got_id, got_lp in zip(entry.top_token_ids, entry.top_logprobs):
            assert abs(float(reference[got_id]) - got_lp) < TOL


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_logprobs_match_hf_alone_and_batched(llm, hf_model, tokenizer, temperature):
    prompts = [tokenizer.encode_prompt(p) for p in BASE_PROMPTS[:3]]
    asking = SamplingParams(max_tokens=8, temperature=temperature, seed=7, logprobs=5, ignore_eos=True)
    quiet = SamplingParams(max_tokens=8, temperature=0.0)
    alone = llm.generate(prompts[0], asking)[0]
    batched = llm.generate(prompts + prompts[1:], [asking] * 3 + [quiet] * 2)
    assert batched[0].token_ids == alone.token_ids
    assert batched[3].samples[0].logprobs is None and batched[3].samples[0].cumulative_logprob is None
    for prompt, result in zip([prompts[0], *prompts], [alone, *batched[:3]]):
        sample = result.samples[0]
        assert len(sample.logprobs) == len(sample.token_ids) == 8
        reference = hf_logprobs(hf_model, prompt + list(sample.token_ids), temperature or 1.0)
        for i, (token_id, entry) in enumerate(zip(sample.token_ids, sample.logprobs)):
            assert_entry_matches(entry, reference[len(prompt) - 1 + i], token_id, 5)
            if temperature == 0.0:
                assert entry.rank == 1
        assert abs(sample.cumulative_logprob - sum(e.logprob for e in sample.logprobs)) < 1e-6


def test_prompt_logprobs_match_hf_over_chunks_and_cached_prefixes(llm, hf_model, tokenizer):
    prompt = tokenizer.encode_prompt(BASE_PROMPTS[15])  # ~130 tokens: several 32-token chunks
    assert len(prompt) > 100
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3)
    first = llm.generate(prompt, params)[0]
    again, other = llm.generate([prompt, tokenizer.encode_prompt(BASE_PROMPTS[1])],
                                [params, SamplingParams(max_tokens=2, temperature=0.0)])  # prefix cached by now
    reference = hf_logprobs(hf_model, prompt)
    for result in (first, again):
        assert len(result.prompt_logprobs) == len(prompt) and result.prompt_logprobs[0] is None
        for position in range(1, len(prompt)):
            assert_entry_matches(result.prompt_logprobs[position], reference[position - 1], prompt[position], 3)
    assert other.prompt_logprobs is None
