"""The default model, its in-process engine and its Hugging Face reference, shared by engine tests."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch


# Prompts of very different lengths (3 to ~150 tokens), written for these tests.
BASE_PROMPTS = [
    "Hello",
    "The capital of France is",
    "Write a short poem about the ocean.",
    "List three benefits of regular exercise:",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the mountains, there lived",
    "Explain in simple words why the sky is blue during the day and red at sunset.",
    "Translate to French: I would like a cup of coffee, please.",
    "Q: What is 17 times 3?\nA:",
    "The three primary colors are",
    "Summarize the plot of a story where a robot learns to paint, in two sentences.",
    "import numpy as np\n# compute the mean of a list of numbers\n",
    "Here is a recipe for pancakes. Ingredients:",
    "My favourite season is autumn because",
    "A haiku about paged memory:",
    " ".join(["The quick brown fox jumps over the lazy dog."] * 12) + " How many times did the fox jump?",
    "In 1969, astronauts first landed on the Moon. Describe what they saw.",
    "Rust and Python differ in that",
]


@pytest.fixture(scope="session")
def hf_model(default_model):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_model, dtype=torch.float32)
    model.eval()
    return model


@pytest.fixture(scope="session")
def tokenizer(default_model):
    from pagedserve.text.tokenizer import PromptTokenizer

    return PromptTokenizer.from_folder(default_model)


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos_token_id: int = 2,
              **generate_options) -> list[int]:
    """Hugging Face greedy generate on one prompt alone (``generate_options`` passed on, e.g.
    ``repetition_penalty``); the new tokens (up to and with EOS)."""
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=eos_token_id, pad_token_id=eos_token_id, **generate_options)
    return out[0, len(prompt_ids):].tolist()


class HfGreedyCheck:
    """Whether generated ids are Hugging Face's greedy continuation, by teacher forcing: one HF forward
    over prompt + output, whose argmax at each output position (after a logits processor, as HF
    generate's ``logits_processor`` would apply it to that prefix) must be the next output id, and the
    output must end with EOS or at ``max_new_tokens``. By induction that is the sequence HF's greedy
    ``generate`` picks (it runs the same model a token at a time from a KV cache: ~2 s a 24-token
    prompt on one thread, the forward ~0.3 s; tests/engine/test_greedy_matches_hf.py checks that both
    agree). Answers without a processor are kept per (prompt, output): the tests that all produce the
    reference cost one forward per prompt in all."""

    def __init__(self, model, eos_token_id: int = 2) -> None:
        self.model, self.eos_token_id = model, eos_token_id
        self._first_difference: dict[tuple[tuple[int, ...], tuple[int, ...], int], int | None] = {}

    def first_difference(self, prompt_ids: list[int], output_ids: list[int], max_new_tokens: int,
                         processor: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> int | None:
        """The index of the first output id that is not HF's greedy choice (``len(output_ids)`` when the
        output stops early without EOS, or runs past ``max_new_tokens``); None when it is HF's greedy
        output. ``processor(input_ids [1, t], scores [1, V]) -> scores`` is a HF logits processor."""
        if processor is not None:
            return self._compare(prompt_ids, output_ids, max_new_tokens, processor)
        key = (tuple(prompt_ids), tuple(output_ids), max_new_tokens)
        if key not in self._first_difference:
            self._first_difference[key] = self._compare(prompt_ids, output_ids, max_new_tokens, None)
        return self._first_difference[key]

    def _compare(self, prompt_ids: list[int], output_ids: list[int], max_new_tokens: int, processor) -> int | None:
        ids = torch.tensor([prompt_ids + output_ids])
        with torch.inference_mode():
            logits = self.model(ids).logits[0]
            start = len(prompt_ids) - 1
            rows = logits[start:start + len(output_ids)]
            if processor is not None:
                rows = torch.cat([processor(ids[:, :start + 1 + i], row[None])[0][None] for i, row in enumerate(rows)])
        choices = rows.argmax(dim=-1).tolist()
        differs = next((i for i, (got, hf) in enumerate(zip(output_ids, choices)) if got != hf), None)
        if differs is not None:
            return differs
        if self.eos_token_id in output_ids[:-1]:  # HF stops at its first EOS
            return output_ids.index(self.eos_token_id) + 1
        ends = len(output_ids) == max_new_tokens or (output_ids and output_ids[-1] == self.eos_token_id)
        return None if ends and len(output_ids) <= max_new_tokens else len(output_ids)


@pytest.fixture(scope="session")
def hf_greedy_check(hf_model) -> HfGreedyCheck:
    return HfGreedyCheck(hf_model)
