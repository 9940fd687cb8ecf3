"""The opt-in fast paths through the real services: a worker started with --gemm-backend onednn, or
with --compile-mode inductor, gives exactly the greedy output of the in-process engine with its
default kernels (``offline_outputs``, shared with test_stack) on these questions."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.e2e.processes import start_stack
from tests.e2e.test_stack import QUESTIONS, assert_all_blocks_free, chat_request, stream

pytestmark = [pytest.mark.e2e, pytest.mark.model]


# (inductor through the stack took 40 s of compiling in CI; compiled outputs are checked in-process in
# tests/worker/test_compiled_forward.py, and up's commands carry --compile-mode: tests/test_launcher_commands.py)
@pytest.mark.parametrize("gemm_backend, compile_mode", [("onednn", "eager")])
def test_worker_fast_path_matches_in_process(tmp_path, default_model, offline_outputs, gemm_backend, compile_mode):
    questions = QUESTIONS[:8]
    stack = start_stack(tmp_path, default_model, num_workers=1, worker_threads=2,
                        worker_args=("--gemm-backend", gemm_backend, "--compile-mode", compile_mode))
    try:
        with ThreadPoolExecutor(len(questions)) as pool:
            results = list(pool.map(lambda q: stream(stack.gateway, chat_request(q)), questions))
        for question, responses in zip(questions, results):
            want = offline_outputs[question]
            assert [t for r in responses for t in r.token_ids] == list(want.token_ids), question
            assert "".join(r.text for r in responses) == want.text, question
        assert_all_blocks_free(stack)
    finally:
        stack.stop()
