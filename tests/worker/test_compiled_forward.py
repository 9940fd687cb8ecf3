"""The opt-in compiled forward (``--compile-mode inductor``): same logits as eager to float32
rounding, greedy outputs equal to transformers, one graph for every batch composition."""

from __future__ import annotations

import random

import pytest
import torch

from pagedserve.engine.attention import TorchAttentionBackend
from pagedserve.engine.runner_factory import build_model_runner
from pagedserve.engine.models.compiled import CompiledForward
from pagedserve.engine.models.panel_gemm import panels_available
from pagedserve.engine.weight_loader import load_model
from tests.worker.tiny_models import (MiniScheduler, forward_step, hf_greedy, hf_model, make_cache, relative_errors,
                                      save_tiny_model)

BLOCK = 4
KV_BYTES = 96 * 2 * 2 * BLOCK * 2 * 16 * 4  # 96 blocks: K+V, 2 layers, block, 2 KV heads, head_dim 16, float32


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = save_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", seed=7)
    return folder, hf_model(folder)


def _prompts(seed: int, *lengths: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 96) for _ in range(n)] for n in lengths]


def test_compiled_logits_equal_eager_on_prefill_decode_and_cached_context(tiny):
    """Ragged prefill, a decode batch, then a prefill over cached context: each step's logits match the
    eager model's on its own copy of the cache (shuffled block tables)."""
    model = load_model(tiny[0])
    compiled = CompiledForward(model)
    eager_cache, compiled_cache = make_cache(model, 48, BLOCK), make_cache(model, 48, BLOCK)
    blocks = random.Random(1).sample(range(48), 30)
    tables = [blocks[0:10], blocks[10:20], blocks[20:30]]
    a, b, c = _prompts(3, 11, 5, 17)
    steps = [([a, b, c], [0, 0, 0]),                 # ragged prefill
             ([[7], [8], [9]], [11, 5, 17]),         # decodes
             ([[3, 4, 5, 6], [10]], [12, 6])]        # prefill over cached context + a decode
    for token_ids, context_lens in steps:
        rows = tables[:len(token_ids)]
        want = forward_step(model, eager_cache, TorchAttentionBackend(), token_ids, context_lens, rows)
        got = forward_step(model, compiled_cache, TorchAttentionBackend(), token_ids, context_lens, rows, compiled)
        rel, rel_max = relative_errors(got, want)
        assert rel < 1e-5 and rel_max < 1e-4, (context_lens, rel, rel_max)


def test_compiled_runner_matches_hf_greedy_without_recompiling(tiny):
    """A runner built with compile_mode=inductor: arrivals, chunked prefill and decodes of several
    sizes give HF's greedy tokens, and after the warm-up no step compiles another graph."""
    from torch._dynamo.utils import counters

    folder, ref = tiny
    runner = build_model_runner(folder, kv_cache_memory_bytes=KV_BYTES, block_size=BLOCK, compile_mode="inductor")
    graphs = counters["stats"]["unique_graphs"]
    sched = MiniScheduler(runner, seed=2)
    prompts = _prompts(4, 9, 14, 3, 6)
    sched.add("p0", prompts[0])
    sched.step({"p0": -1})
    sched.add("p1", prompts[1])
    sched.step({"p0": 1, "p1": 8})                     # a decode with a prefill chunk
    sched.add("p2", prompts[2])
    sched.add("p3", prompts[3])
    sched.step({"p1": -1, "p2": -1, "p3": -1, "p0": 1})
    for _ in range(7):
        sched.step({rid: 1 for rid in ("p0", "p1", "p2", "p3")})
    for i, prompt in enumerate(prompts):
        got = sched.outputs(f"p{i}")
        assert len(got) >= 7 and got == hf_greedy(ref, prompt, len(got)), i
    assert counters["stats"]["unique_graphs"] == graphs, "a step compiled a new graph"


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch without oneDNN")
@pytest.mark.parametrize("gemm", ["onednn", "panels"])
def test_compiled_forward_with_packed_gemms_matches_eager(tiny, gemm):
    """oneDNN and panel layers stay opaque custom ops inside the compiled graph: same greedy tokens as eager."""
    if gemm == "panels" and not panels_available():
        pytest.skip("the panel GEMM needs an x86 CPU with AVX2 and FMA and a C++ compiler")
    folder, _ = tiny
    outputs = []
    for mode in ("eager", "inductor"):
        runner = build_model_runner(folder, kv_cache_memory_bytes=KV_BYTES, block_size=BLOCK,
                                    gemm_backend=gemm, compile_mode=mode)
        sched = MiniScheduler(runner, seed=3)
        for i, prompt in enumerate(_prompts(5, 12, 4, 20)):
            sched.add(f"p{i}", prompt)
        sched.step({"p0": -1, "p1": -1, "p2": -1})
        for _ in range(8):
            sched.step({"p0": 1, "p1": 1, "p2": 1})
        outputs.append([sched.outputs(f"p{i}") for i in range(3)])
    assert outputs[0] == outputs[1]
