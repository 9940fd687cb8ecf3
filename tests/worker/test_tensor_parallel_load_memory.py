"""Issue #12: the peak memory of each rank while it loads stays under its share of the model plus one
tensor (measured as ``tests/worker/load_memory.py`` explains: the CPU allocator's running total)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch
from safetensors.torch import load_file, save_file

from tests.worker.tiny_models import save_tiny_model

# hidden 256, 8 query / 4 KV heads of 32, MLP 512, 4 layers, vocabulary 4096, untied head.
CONFIG = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
              num_key_value_heads=4, vocab_size=4096, tie_word_embeddings=False)
SLACK = 64 << 10  # bytes for small temporaries; measured: none (peak == shard + largest slice)


def _rank_params() -> int:
    """Parameters of one rank of 2: half of every matrix, whole norms, plus rotary inv_freq (16)."""
    h, kv, i, v, layers = 256, 128, 512, 4096, 4
    per_layer = (h + 2 * kv) * h // 2 + h * h // 2 + 2 * i * h // 2 + h * i // 2 + 2 * h
    return 2 * (v // 2) * h + layers * per_layer + h + 16


def test_each_rank_peaks_under_its_share_plus_one_slice(tmp_path):
    folder = save_tiny_model(tmp_path / "m", "llama", seed=3, **CONFIG)
    # Stored as bfloat16 like most published checkpoints, loaded as float32: every parameter of the
    # shard is the loader's own conversion (none stays a view of the mapped file).
    path = folder / "model.safetensors"
    save_file({k: t.to(torch.bfloat16) for k, t in load_file(path).items()}, path, metadata={"format": "pt"})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    runs = [subprocess.Popen([sys.executable, "-m", "tests.worker.load_memory", str(folder), str(rank), "2"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for rank in range(2)]
    for rank, run in enumerate(runs):  # one fresh process a rank: nothing else allocates in it
        out, err = run.communicate(timeout=120)
        assert run.returncode == 0, err
        got = json.loads(out.strip().splitlines()[-1])
        assert got["shard"] == 4 * _rank_params() == 8922176, got
        assert got["largest_slice"] == 4 * 2048 * 256 < got["largest_tensor"] == 4 * 4096 * 256
        assert got["shard"] <= got["peak"] <= got["shard"] + got["largest_slice"] + SLACK, got
