"""The kernels and precisions a worker can be started with, through the real services: a worker with
--gemm-backend torch (the reference F.linear GEMMs), or the packed GEMM that is not this CPU's default
(onednn where auto takes the panel GEMM, else panels), gives the in-process engine's default output
(models/onednn.resolve_gemm_backend) on these questions; a worker with
--dtype bfloat16 gives exactly the in-process bfloat16 engine's, one question at a time (the same
kernels on the same row counts: bfloat16 rows are not batch-invariant on CPUs with AMX, whose
kernels oneDNN takes for larger batches: models/onednn.py); so does a worker with --kv-cache-dtype
fp8_e5m2 the in-process engine with fp8_e5m2 KV (the fp8 and bfloat16 answers are first checked to differ from
float32's, so an ignored flag fails; the GEMM backends give float32's tokens whichever runs). The float32 and fp8
stacks serve the small random-weight model: these check that a worker started with the flag serves what the
in-process engine computes, and the kernels' results on the default model are checked in-process
(tests/engine/test_greedy_matches_hf.py, test_kv_cache_dtype_logprobs.py); the bfloat16 stack serves the default
model (CPUs with bfloat16 only)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from pagedserve.engine.cpu_features import BF16_CPU_FLAGS, cpu_flags
from pagedserve.engine.models.panel_gemm import panels_available, panels_preferred
from tests.e2e.processes import start_stack
from tests.e2e.test_stack import QUESTIONS, assert_all_blocks_free, chat_request, stream

pytestmark = [pytest.mark.e2e, pytest.mark.model]


def assert_stack_gives(tmp_path, model, worker_args: tuple[str, ...], want: dict, concurrency: int) -> None:
    """Starts a one-worker stack with ``worker_args`` and checks each of ``want``'s questions, asked
    ``concurrency`` at a time, streams exactly its ids and text."""
    questions = list(want)
    stack = start_stack(tmp_path, model, num_workers=1, worker_threads=2, worker_args=worker_args)
    try:
        with ThreadPoolExecutor(concurrency) as pool:
            results = list(pool.map(lambda q: stream(stack.gateway, chat_request(q)), questions))
        for question, responses in zip(questions, results):
            assert [t for r in responses for t in r.token_ids] == list(want[question].token_ids), question
            assert "".join(r.text for r in responses) == want[question].text, question
        assert_all_blocks_free(stack)
    finally:
        stack.stop()


# (inductor through the stack took 40 s of compiling in CI; compiled outputs are checked in-process in
# tests/worker/test_compiled_forward.py, and up's commands carry --compile-mode: tests/test_launcher_commands.py)
@pytest.mark.parametrize("gemm", ["torch", "onednn" if panels_preferred() else "panels"])
def test_a_worker_with_other_gemms_matches_in_process_default(tmp_path, small_model, small_offline_outputs, gemm):
    if gemm == "panels" and not panels_available():
        pytest.skip("the panel GEMM needs an x86 CPU with AVX2 and FMA and a C++ compiler")
    want = {q: small_offline_outputs[q] for q in QUESTIONS[:8]}
    assert_stack_gives(tmp_path, small_model, ("--gemm-backend", gemm), want, concurrency=len(want))


def in_process_answers(model, questions: list[str], float32_outputs, **options) -> dict:
    """The in-process engine's greedy answers (24 tokens) with ``options``, one question at a time;
    checked to differ from the float32 default's on some question (else a worker that ignored the
    options would pass)."""
    from pagedserve.engine.sampling_params import SamplingParams
    from pagedserve.llm import LLM
    from pagedserve.text.tokenizer import ChatTurn

    llm = LLM(model, kv_cache_memory="64MiB", **options)
    results = [llm.chat([[ChatTurn("user", q)]], SamplingParams(max_tokens=24, temperature=0.0))[0] for q in questions]
    del llm
    assert any(r.token_ids != float32_outputs[q].token_ids for q, r in zip(questions, results)), \
        f"{options} gave float32's output on every question: the stack check would not see them ignored"
    return dict(zip(questions, results))


@pytest.mark.skipif(not cpu_flags() & set(BF16_CPU_FLAGS), reason="CPU without native bfloat16")
def test_bfloat16_worker_matches_in_process_bfloat16(tmp_path, default_model, offline_outputs):
    want = in_process_answers(default_model, QUESTIONS[:4], offline_outputs, dtype="bfloat16")
    assert_stack_gives(tmp_path, default_model, ("--dtype", "bfloat16"), want, concurrency=1)


def test_fp8_kv_cache_worker_matches_in_process_fp8_kv_cache(tmp_path, small_model, small_offline_outputs):
    """K/V stored as fp8_e5m2 in the worker round as in the in-process engine: the same answers."""
    want = in_process_answers(small_model, QUESTIONS[:4], small_offline_outputs, kv_cache_dtype="fp8_e5m2")
    assert_stack_gives(tmp_path, small_model, ("--kv-cache-dtype", "fp8_e5m2"), want, concurrency=1)
