"""The opt-in oneDNN GEMMs through the real services: a worker started with --gemm-backend onednn
gives exactly the in-process engine's greedy output with the same kernels."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.e2e.processes import start_stack
from tests.e2e.test_stack import QUESTIONS, assert_all_blocks_free, chat_request, stream

pytestmark = [pytest.mark.e2e, pytest.mark.model]


def test_worker_with_onednn_gemms_matches_in_process(tmp_path, default_model):
    from pagedserve.engine.sampling_params import SamplingParams
    from pagedserve.llm import LLM
    from pagedserve.text.tokenizer import ChatTurn

    questions = QUESTIONS[:8]
    llm = LLM(default_model, kv_cache_memory="64MiB", gemm_backend="onednn")
    expected = llm.chat([[ChatTurn("user", q)] for q in questions], SamplingParams(max_tokens=24, temperature=0.0))
    del llm
    stack = start_stack(tmp_path, default_model, num_workers=1, worker_threads=2,
                        worker_args=("--gemm-backend", "onednn"))
    try:
        with ThreadPoolExecutor(len(questions)) as pool:
            results = list(pool.map(lambda q: stream(stack.gateway, chat_request(q)), questions))
        for question, responses, want in zip(questions, results, expected):
            assert "".join(r.text for r in responses) == want.text, question
        assert_all_blocks_free(stack)
    finally:
        for p in stack.processes.values():
            p.stop()
