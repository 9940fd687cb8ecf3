"""The engine with the Triton attention backend (interpreted on CPU) gives the same greedy tokens as
with the torch backend, through prefill, chunked prefill and decode."""

from __future__ import annotations

import random

import pytest
from kernel_test_utils import DEVICE

from pagedserve.engine.messages import EngineRequest
from pagedserve.engine.sampling_params import EngineSamplingParams
from pagedserve.engine.config import SchedulerConfig
from pagedserve.engine.engine import Engine, LocalExecutor
from pagedserve.engine.scheduler import Scheduler
from pagedserve.engine.attention import TritonAttentionBackend
from pagedserve.engine.runner_factory import build_model_runner
from tests.worker.tiny_models import save_tiny_model

BLOCK = 8


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    # head_dim 32 (hidden 128 / 4 heads), 2 KV heads: GQA ratio 2
    return save_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", seed=5, hidden_size=128)


def greedy_outputs(folder, backend: str, kv_cache_dtype: str = "auto") -> dict[str, list[int]]:
    runner = build_model_runner(folder, kv_cache_memory_bytes=1 << 22, block_size=BLOCK, attention_backend=backend,
                                kv_cache_dtype=kv_cache_dtype, device=DEVICE)
    scheduler = Scheduler(SchedulerConfig(block_size=BLOCK, max_num_seqs=8, max_num_batched_tokens=16))
    scheduler.add_worker("w", runner.num_blocks)
    engine = Engine(scheduler, LocalExecutor({"w": runner}))
    rng = random.Random(0)
    for i, length in enumerate((1, 5, 11, 29)):  # 29 > the 16-token budget: prefilled in chunks
        prompt = tuple(rng.randrange(3, 96) for _ in range(length))
        engine.add_request(EngineRequest(f"r{i}", prompt, EngineSamplingParams(max_tokens=6, temperature=0.0), i))
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
    return outputs


def test_triton_backend_matches_torch_backend(tiny):
    reference = greedy_outputs(tiny, "torch")
    assert greedy_outputs(tiny, "triton") == reference
    assert all(len(tokens) == 6 for tokens in reference.values())


def test_auto_picks_the_cpu_op_on_cpu(tiny):
    from pagedserve.engine.attention import CpuAttentionBackend, TorchAttentionBackend, make_attention_backend
    from pagedserve.engine.attention.cpu_op import load_cpu_attention_op

    expected = CpuAttentionBackend if load_cpu_attention_op() is not None else TorchAttentionBackend
    assert type(make_attention_backend("auto", "cpu")) is expected
    assert isinstance(make_attention_backend("torch", "cpu"), TorchAttentionBackend)
    assert isinstance(make_attention_backend("triton", "cpu"), TritonAttentionBackend)
    with pytest.raises(ValueError, match="attention backend"):
        make_attention_backend("cuda-magic", "cpu")
