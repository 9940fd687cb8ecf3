"""Fixtures of the end-to-end tests (the stack itself is in tests/conftest.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def offline_outputs(default_llm):
    """Greedy outputs of the in-process engine for QUESTIONS (the reference for the stack)."""
    from pagedserve.engine.sampling_params import SamplingParams
    from pagedserve.text.tokenizer import ChatTurn

    params = SamplingParams(max_tokens=24, temperature=0.0)
    from tests.e2e.test_stack import QUESTIONS

    results = default_llm.chat([[ChatTurn("user", q)] for q in QUESTIONS], params)
    return {q: r for q, r in zip(QUESTIONS, results)}
