"""ModelRunner: ragged prefill/decode batches, arrivals, chunked prefill, preemption, plan checks."""

from __future__ import annotations

import random

import pytest
import torch

from pagedserve.engine.cpu_features import ONEDNN_BF16_CPU_FLAGS, cpu_flags
from pagedserve.engine.messages import BatchPlan, CachedRequestData, NewRequestData, SequenceId, StepResult
from pagedserve.engine.sampling_params import EngineSamplingParams
from pagedserve.engine.model_runner import PlanMismatchError
from pagedserve.engine.runner_factory import build_model_runner
from tests.worker.tiny_models import GREEDY, MiniScheduler, hf_greedy, hf_model, save_tiny_model

BLOCK = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = save_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", seed=3)
    return folder, hf_model(folder)


def _runner(folder, num_blocks: int = 96):
    per_block = 2 * 2 * BLOCK * 2 * 16 * 4  # K+V, 2 layers, block, 2 KV heads, head_dim 16, float32
    return build_model_runner(folder, kv_cache_memory_bytes=num_blocks * per_block, block_size=BLOCK,
                              sampler_seed=0)


def _prompts(seed: int, *lengths: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 96) for _ in range(n)] for n in lengths]


def test_runner_geometry(tiny):
    runner = _runner(tiny[0], 96)
    assert runner.num_blocks == 96 and runner.block_size == BLOCK


def test_ragged_batch_with_arrivals_matches_hf_greedy(tiny):
    folder, ref = tiny
    sched = MiniScheduler(_runner(folder))
    a, b, c = _prompts(1, 13, 6, 1)
    sched.add("a", a)
    assert [s.request_id for s in sched.step({"a": -1}).sampled] == ["a"]
    sched.add("b", b)
    sched.step({"a": 1, "b": -1})          # decode + prefill
    sched.add("c", c)                      # a one-token prompt arrives
    result = sched.step({"b": 1, "c": -1, "a": 1})
    assert [s.request_id for s in result.sampled] == ["c", "b", "a"]  # plan order: new, then cached
    for _ in range(9):
        sched.step({"a": 1, "b": 1, "c": 1})
    for rid, prompt in (("a", a), ("b", b), ("c", c)):
        got = sched.outputs(rid)
        assert got == hf_greedy(ref, prompt, len(got)), rid


@pytest.mark.parametrize("chunks", [[8, 8, 4, 3], [5, 6, 7, 5], [23]])
def test_chunked_prefill_matches_hf_greedy(tiny, chunks):
    folder, ref = tiny
    sched = MiniScheduler(_runner(folder), seed=len(chunks))
    long_prompt, other = _prompts(2, sum(chunks), 9)
    sched.add("other", other)
    sched.step({"other": -1})
    sched.add("long", long_prompt)
    for i, n in enumerate(chunks):
        sampled = {s.request_id for s in sched.step({"long": n, "other": 1}).sampled}
        assert sampled == ({"long", "other"} if i == len(chunks) - 1 else {"other"})
    for _ in range(6):
        sched.step({"long": 1, "other": 1})
    assert sched.outputs("long") == hf_greedy(ref, long_prompt, 7)
    assert sched.outputs("other") == hf_greedy(ref, other, len(sched.outputs("other")))


def test_reprefill_after_preemption_matches_hf_greedy(tiny):
    folder, ref = tiny
    sched = MiniScheduler(_runner(folder))
    p, q = _prompts(3, 11, 17)
    sched.add("p", p)
    sched.add("q", q)
    sched.step({"p": -1, "q": -1})
    for _ in range(4):
        sched.step({"p": 1, "q": 1})
    sched.preempt("p")                     # dropped; its blocks may now go to q
    for _ in range(3):
        sched.step({"q": 1})
    sched.step({"p": 9, "q": 1})           # re-prefill prompt + generated tokens, in two chunks
    sched.step({"p": -1, "q": 1})
    for _ in range(3):
        sched.step({"p": 1, "q": 1})
    assert sched.outputs("p") == hf_greedy(ref, p, len(sched.outputs("p")))
    assert sched.outputs("q") == hf_greedy(ref, q, len(sched.outputs("q")))


def test_empty_plan_returns_empty_result(tiny):
    runner = _runner(tiny[0])
    assert runner.execute(BatchPlan(step_id=7)) == StepResult(step_id=7)


def test_plan_mismatches_raise(tiny):
    runner = _runner(tiny[0])
    new = NewRequestData(SequenceId("r"), (5, 6, 7), 3, (4,), 0, 3, GREEDY)
    runner.execute(BatchPlan(1, new_requests=(new,)))
    with pytest.raises(PlanMismatchError, match="computed"):
        runner.execute(BatchPlan(2, cached_requests=(CachedRequestData(SequenceId("r"), (), 2, 1),)))
    with pytest.raises(PlanMismatchError, match="unknown"):
        runner.execute(BatchPlan(2, cached_requests=(CachedRequestData(SequenceId("nope"), (), 0, 1),)))
    with pytest.raises(PlanMismatchError, match="already holds"):
        runner.execute(BatchPlan(2, new_requests=(new,)))
    with pytest.raises(PlanMismatchError, match="cannot hold"):  # 5 tokens need a second block
        runner.execute(BatchPlan(2, new_requests=(NewRequestData(SequenceId("x"), (1, 2, 3, 4, 5), 5, (8,), 0, 5, GREEDY),)))
    with pytest.raises(PlanMismatchError, match="exceeds"):  # r knows 4 tokens: prompt + 1 sampled
        runner.execute(BatchPlan(2, cached_requests=(CachedRequestData(SequenceId("r"), (9,), 3, 2),)))
    result = runner.execute(BatchPlan(3, cached_requests=(CachedRequestData(SequenceId("r"), (), 3, 1),)))
    assert [s.request_id for s in result.sampled] == ["r"]  # failed plans left the state intact
    runner.execute(BatchPlan(4, finished_seq_ids=(SequenceId("r"),)))
    assert "r" not in runner.requests and "x" not in runner.requests


def test_seeded_sampling_survives_preemption(tiny):
    """A seeded request draws the same tokens when recomputed on another runner from prompt + outputs."""
    folder, _ = tiny
    params = EngineSamplingParams(max_tokens=64, temperature=1.0, seed=42)
    (prompt,) = _prompts(4, 10)
    first = MiniScheduler(_runner(folder))
    first.add("s", prompt, params)
    first.step({"s": -1})
    for _ in range(7):
        first.step({"s": 1})
    moved = MiniScheduler(_runner(folder), seed=5)
    moved.add("s", prompt, params)
    moved.reqs["s"].tokens += first.outputs("s")[:4]  # NewRequestData carries prompt + 4 generated
    moved.step({"s": -1})
    for _ in range(3):
        moved.step({"s": 1})
    assert moved.outputs("s") == first.outputs("s")
    assert len(set(first.outputs("s"))) > 1


def test_kv_budget_too_small_raises(tiny):
    with pytest.raises(ValueError, match="holds no block"):
        build_model_runner(tiny[0], kv_cache_memory_bytes=100, block_size=BLOCK)


@pytest.mark.skipif(not cpu_flags() & set(ONEDNN_BF16_CPU_FLAGS), reason="oneDNN has no bfloat16 GEMM on this CPU")
def test_bfloat16_runner_runs_a_mixed_batch(tiny):
    runner = build_model_runner(tiny[0], kv_cache_memory_bytes=1 << 20, block_size=BLOCK, dtype=torch.bfloat16)
    assert runner.kv_cache.key_caches[0].dtype == torch.bfloat16
    sched = MiniScheduler(runner)
    a, b = _prompts(5, 7, 19)
    sched.add("a", a)
    sched.add("b", b)
    sched.step({"a": -1, "b": 8})
    sched.step({"a": 1, "b": -1})
    for _ in range(3):
        sched.step({"a": 1, "b": 1})
    assert len(sched.outputs("a")) == 5 and len(sched.outputs("b")) == 4
    assert all(0 <= t < 96 for t in sched.outputs("a") + sched.outputs("b"))
