"""Fixtures shared by every test directory: the default model and one real stack per session."""

from __future__ import annotations

import pytest

from pagedserve.model_files import prepare_default_model
from tests.e2e.processes import start_stack


def pytest_configure(config):
    """Holds one reference to grpc.aio for the whole session. grpc.aio joins its poller thread when
    its last object is finalized, and a half-stopped server finalized by a garbage collection in any
    thread (a model thread mid-forward, a hypothesis draw) waited on that join for ever: py-spy showed
    gc_collect -> cygrpc -> Thread.join of `_poll_wrapper` in the stalls of 600 s in full runs."""
    import grpc.aio

    grpc.aio.init_grpc_aio()


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
