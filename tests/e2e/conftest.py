"""Fixtures of the end-to-end tests (the stack itself is in tests/conftest.py)."""

from __future__ import annotations

import pytest


def greedy_answers(llm) -> dict:
    """Greedy outputs (24 tokens) of the in-process engine ``llm`` for each of QUESTIONS."""
    from pagedserve.engine.sampling_params import SamplingParams
    from pagedserve.text.tokenizer import ChatTurn
    from tests.e2e.test_stack import QUESTIONS

    results = llm.chat([[ChatTurn("user", q)] for q in QUESTIONS], SamplingParams(max_tokens=24, temperature=0.0))
    return {q: r for q, r in zip(QUESTIONS, results)}


@pytest.fixture(scope="session")
def offline_outputs(default_llm):
    """The default model's greedy answers in-process (the reference for ``stack``)."""
    return greedy_answers(default_llm)


@pytest.fixture(scope="session")
def small_offline_outputs(small_llm):
    """The small model's greedy answers in-process (the reference for ``small_stack``)."""
    return greedy_answers(small_llm)
