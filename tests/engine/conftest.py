"""The default model, its in-process engine and its Hugging Face reference, shared by engine tests."""

from __future__ import annotations

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


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos_token_id: int = 2) -> list[int]:
    """Hugging Face greedy generate on one prompt alone; the new tokens (up to and with EOS)."""
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=eos_token_id, pad_token_id=eos_token_id)
    return out[0, len(prompt_ids):].tolist()
