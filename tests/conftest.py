"""Fixtures shared by every test directory: the default model and one real stack per session."""

from __future__ import annotations

import pytest

from pagedserve.model_files import prepare_default_model
from tests.e2e.processes import start_stack


@pytest.fixture(scope="session")
def default_model():
    return prepare_default_model()


@pytest.fixture(scope="session")
def default_llm(default_model):
    """One in-process engine on the default model (64 MiB of KV cache), loaded once for the tests
    that only generate with it (greedy or seeded; none asserts its stats)."""
    from pagedserve.llm import LLM

    return LLM(default_model, kv_cache_memory="64MiB")


@pytest.fixture(scope="session")
def stack(tmp_path_factory, default_model):
    # Spans are printed to each service's log, so the tracing test can follow one request.
    s = start_stack(tmp_path_factory.mktemp("stack"), default_model, env_extra={"OTEL_TRACES_EXPORTER": "console"})
    yield s
    s.stop()
