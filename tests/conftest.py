"""Fixtures shared by every test directory: the default model and one real stack per session."""

from __future__ import annotations

import pytest

from pagedserve.model_files import prepare_default_model
from tests.e2e.processes import start_stack


def _openmp_threads_sleep_while_they_wait() -> None:
    """Sets OMP_WAIT_POLICY=passive (unless set) for the test processes and every service they
    start, before torch loads its OpenMP runtime (so as this conftest is imported: the directories'
    conftests import torch before any ``pytest_configure``): a thread that waits for work or at a
    barrier sleeps instead of spinning. The suite runs more processes than cores, so a spinning thread
    burns a core that another test needs, often while the thread it waits for is descheduled (libgomp
    throttles its spinning only when one process has more threads than cores). tests/e2e/test_cli.py
    beside two busy loops: 131 s wall and 121 CPU-s with the default policy, 69 s and 53 CPU-s
    passive; with nothing beside them, test_gemm_backend's two stacks took 38 and 35 CPU-s in the same
    wall time.
    Served workers keep the default: their threads own their cores there."""
    import os

    os.environ.setdefault("OMP_WAIT_POLICY", "passive")


_openmp_threads_sleep_while_they_wait()


def pytest_configure(config):
    """Holds one reference to grpc.aio for the whole session. grpc.aio joins its poller thread when
    its last object is finalized, and a half-stopped server finalized by a garbage collection in any
    thread (a model thread mid-forward, a hypothesis draw) waited on that join for ever: py-spy showed
    gc_collect -> cygrpc -> Thread.join of `_poll_wrapper` in the stalls of 600 s in full runs."""
    import grpc.aio

    grpc.aio.init_grpc_aio()
    _one_thread_per_process_when_workers_fill_the_cores()


def _one_thread_per_process_when_workers_fill_the_cores() -> None:
    """With as many pytest-xdist workers as cores (scripts/test.sh runs 3 on 2), each test process
    and every service it starts runs torch on one thread: two threads each only fight over the cores
    (tests/engine/test_penalties_and_stops.py beside two busy processes: 70 s wall and 62 CPU-s with
    two threads, 57 s and 38 CPU-s with one). Services get it through OMP_NUM_THREADS; a worker
    started with --num-threads, and the ranks of a parallel engine, still take what they are given."""
    import os

    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers < (os.cpu_count() or 1):
        return
    import torch

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def default_model():
    return prepare_default_model()


SMALL_MODEL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, max_position_embeddings=8192, tie_word_embeddings=False,
                   bos_token_id=1, eos_token_id=2, pad_token_id=2)
"""A 2-layer llama as wide as a toy: forward steps and loads ~20x cheaper than the default model's. Its LM head is
its own random matrix (not the embedding's): with a tied head each token's own logit dominated and greedy outputs
repeated one or two ids, where now nearly every generated id differs (8 chat streams of 48-62 tokens: 42-62
distinct ids each), so a token lost, repeated or taken from another stream changes what follows."""
SMALL_BLOCK_BYTES = (2 * SMALL_MODEL["num_hidden_layers"] * 16 * SMALL_MODEL["num_key_value_heads"]
                     * SMALL_MODEL["head_dim"] * 4)
"""K and V of one 16-token block of every layer of ``SMALL_MODEL``, float32."""


def save_small_model(folder, default_model, seed: int = 11, **overrides):
    """Writes a random-weight ``SMALL_MODEL`` (with ``overrides`` of its config; weights drawn with ``seed``)
    with the default model's tokenizer, chat template and 49,152-id vocabulary to ``folder``; returns it."""
    import shutil

    from tests.worker.tiny_models import save_tiny_model

    save_tiny_model(folder, "llama", seed=seed, vocab_size=49152, **{**SMALL_MODEL, **overrides})
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copy(default_model / name, folder / name)
    return folder


@pytest.fixture(scope="session")
def small_model(tmp_path_factory, default_model):
    """``SMALL_MODEL`` (``save_small_model``), for tests whose checks hold on any model (plumbing, faults, the
    equality of two paths, benchmark reports): anything that runs the default model runs it, only faster."""
    return save_small_model(tmp_path_factory.mktemp("small-model"), default_model)


@pytest.fixture(scope="session")
def small_llm(small_model):
    """One in-process engine on ``small_model`` (64 MiB of KV cache): the reference of the tests that run
    stacks or speculation on it (greedy; none asserts its stats)."""
    from pagedserve.llm import LLM

    return LLM(small_model, kv_cache_memory="64MiB")


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


@pytest.fixture(scope="session")
def small_stack(tmp_path_factory, small_model):
    """A stack like ``stack`` on ``small_model``, for the tests of how requests live through the services
    (ids, aborts, faults), whose checks hold on any model: its steps cost a fraction of the default model's."""
    s = start_stack(tmp_path_factory.mktemp("small-stack"), small_model)
    yield s
    s.stop()


SLOWEST_FILES_FIRST = (
    "tests/e2e/test_chaos.py", "tests/e2e/test_request_lifecycle.py", "tests/e2e/test_cli_first_minutes.py",
    "tests/engine/test_speculative_decoding.py", "tests/engine/test_greedy_matches_hf.py", "tests/e2e/test_cli.py",
    "tests/bench/test_offline_benches.py", "tests/e2e/test_speculative_stack.py",
    "tests/e2e/test_scheduler_migration.py", "tests/engine/test_kv_cache_dtype_logprobs.py",
    "tests/engine/test_structured_outputs.py", "tests/worker/test_parallel_architectures.py",
    "tests/e2e/test_run_script.py", "tests/worker/test_pipeline_parallel_llm.py", "tests/e2e/test_structured_outputs.py",
    "tests/engine/test_tensor_parallel_default_model.py", "tests/e2e/test_requests_across_restarts.py",
    "tests/e2e/test_chaos_own_stacks.py",
)
"""The test files that took longest in a full run (2026-12-06, 811 s, 2 cores), longest first. scripts/test.sh hands
files to its xdist workers in collection order (``--no-loadscope-reorder``): these go first, so no
long file starts last and leaves the other workers idle (the last 6 minutes of a run used one or two)."""


def pytest_collection_modifyitems(session, config, items):
    """Puts ``SLOWEST_FILES_FIRST`` at the front, in that order (a stable sort: the rest as collected)."""
    rank = {path: i for i, path in enumerate(SLOWEST_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))
