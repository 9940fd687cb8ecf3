"""The default model with penalties, logit_bias, min_tokens, stop reasons and best_of, in process:
greedy outputs with repetition_penalty=1.3 (and OpenAI's frequency/presence formula) are Hugging
Face's greedy choices under the same logits processor token for token (teacher forcing:
``HfGreedyCheck``), alone and batched with unpenalized requests."""

from __future__ import annotations

import pytest
import torch

from pagedserve.engine.messages import FinishReason
from pagedserve.engine.sampling_params import SamplingParams
from tests.engine.conftest import BASE_PROMPTS, hf_greedy

pytestmark = pytest.mark.model

MAX_TOKENS = 16
PROMPTS = [BASE_PROMPTS[i] for i in (1, 4, 8, 15)]


@pytest.fixture(scope="module")
def llm(default_llm):
    return default_llm


class OpenAIPenalties:
    """HF logits processor: OpenAI's frequency/presence penalties over the tokens after the prompt."""

    def __init__(self, prompt_len: int, frequency: float, presence: float) -> None:
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        counts = torch.zeros_like(scores).scatter_add_(
            1, input_ids[:, self.prompt_len:], torch.ones_like(input_ids[:, self.prompt_len:], dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).float()


def test_repetition_penalty_matches_hf_alone_and_batched(llm, hf_model, hf_greedy_check, tokenizer):
    from transformers import RepetitionPenaltyLogitsProcessor

    ids = [tokenizer.encode_prompt(p) for p in PROMPTS]
    penalized = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, repetition_penalty=1.3)
    plain = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    alone = [list(llm.generate(i, penalized)[0].token_ids) for i in ids]
    batched = [list(r.token_ids) for r in llm.generate(ids + ids, [penalized] * len(ids) + [plain] * len(ids))]
    assert batched[:len(ids)] == alone
    assert alone != batched[len(ids):]  # the penalty changes something
    penalty = RepetitionPenaltyLogitsProcessor(1.3)  # what HF generate(repetition_penalty=1.3) applies
    for i in range(len(ids)):
        assert hf_greedy_check.first_difference(ids[i], alone[i], MAX_TOKENS, penalty) is None, PROMPTS[i]
        assert hf_greedy_check.first_difference(ids[i], batched[len(ids) + i], MAX_TOKENS) is None, PROMPTS[i]
    # and the check sees the penalty: the penalized outputs are not HF's unpenalized choices
    assert any(hf_greedy_check.first_difference(i, out, MAX_TOKENS) is not None for i, out in zip(ids, alone))
    # and the processor path is HF generate's own (one prompt: generate costs ~2 s)
    assert hf_greedy(hf_model, ids[0], MAX_TOKENS, repetition_penalty=1.3) == alone[0]


def test_frequency_and_presence_penalties_match_openai_formula(llm, hf_greedy_check, tokenizer):
    ids = tokenizer.encode_prompt("The quick brown fox jumps over the lazy dog. " * 3)  # greedy repeats it
    params = SamplingParams(max_tokens=32, temperature=0.0, frequency_penalty=2.0, presence_penalty=1.0)
    got = llm.generate([ids, ids], [params, SamplingParams(max_tokens=32, temperature=0.0)])
    openai = OpenAIPenalties(len(ids), 2.0, 1.0)
    assert hf_greedy_check.first_difference(ids, list(got[0].token_ids), 32, openai) is None
    assert got[0].token_ids != got[1].token_ids


def test_logit_bias_forces_a_token(llm, tokenizer):
    token = tokenizer.encode_prompt(" banana")[-1]
    result = llm.generate("The capital of France is", SamplingParams(
        max_tokens=5, temperature=0.0, logit_bias={token: 100.0}, logprobs=1))[0]
    assert result.token_ids == (token,) * 5
    assert all(e.logprob > -1e-3 and e.rank == 1 for e in result.samples[0].logprobs)


def test_min_tokens_holds_back_a_stop_string(llm):
    prompt = BASE_PROMPTS[8]  # "Q: What is 17 times 3?\nA:"
    stopped = llm.generate(prompt, SamplingParams(max_tokens=50, temperature=0.0, stop=["\n"]))[0]
    assert stopped.finish_reason is FinishReason.STOP and len(stopped.token_ids) < 50
    assert stopped.samples[0].stop_reason == "\n"
    held = llm.generate(prompt, SamplingParams(max_tokens=50, min_tokens=50, temperature=0.0, stop=["\n"]))[0]
    assert len(held.token_ids) == 50 and held.finish_reason is FinishReason.LENGTH
    assert "\n" in held.text and held.samples[0].stop_reason is None


def test_stop_reason_of_a_stop_token_id(llm):
    prompt = BASE_PROMPTS[1]
    free = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0].token_ids
    index = next(i for i in range(2, len(free)) if free[i] not in free[:i])
    result = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=(free[index],)))[0]
    assert result.token_ids == free[:index + 1]
    assert result.finish_reason is FinishReason.STOP and result.samples[0].stop_reason == free[index]


def test_best_of_returns_the_samples_of_highest_cumulative_logprob(llm):
    prompt = BASE_PROMPTS[13]
    every = llm.generate(prompt, SamplingParams(max_tokens=6, temperature=1.0, seed=3, n=5, logprobs=0,
                                                ignore_eos=True))[0].samples
    best = llm.generate(prompt, SamplingParams(max_tokens=6, temperature=1.0, seed=3, n=2, best_of=5,
                                               ignore_eos=True))[0].samples
    ranked = sorted(every, key=lambda s: -s.cumulative_logprob)
    assert len({s.token_ids for s in every}) > 2  # distinct samples to choose from
    assert [s.token_ids for s in best] == [s.token_ids for s in ranked[:2]]
    assert all(s.logprobs is None and s.cumulative_logprob is not None for s in best)
