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


# hidden 256 in 8 heads, MLP 512 (Mixtral: 4 experts of 256), 2 layers, vocabulary 4096, per architecture.
_WIDTHS = dict(num_attention_heads=8, vocab_size=4096)
OTHER_ARCHITECTURES = {
    "gpt_neox": dict(hidden_size=256, intermediate_size=512, **_WIDTHS),
    "falcon": dict(hidden_size=256, ffn_hidden_size=512, num_kv_heads=2, **_WIDTHS),  # 1 KV head per rank
    "gpt2": dict(n_embd=256, n_inner=512, n_head=8, vocab_size=4096),
    "mixtral": dict(hidden_size=256, intermediate_size=256, num_key_value_heads=4, num_local_experts=4,
                    num_experts_per_tok=2, sliding_window=None, **_WIDTHS),
    "qwen3": dict(hidden_size=256, intermediate_size=512, num_key_value_heads=4, head_dim=32, **_WIDTHS),
}
FALCON_MULTI_QUERY = dict(hidden_size=256, ffn_hidden_size=512, new_decoder_architecture=False, multi_query=True,
                          **_WIDTHS)  # the KV head replicated: q rows and k/v rows read as two ranges


def test_every_architecture_peaks_under_its_share_plus_one_slice(tmp_path):
    """The other architectures' slices (fused QKV by KV-head groups, Conv1D columns, experts) keep the
    same bound: measured, NeoX's is 3 KiB over (its QKV re-layout index), the others none."""
    configs = {**{arch: (arch, c) for arch, c in OTHER_ARCHITECTURES.items()},
               "falcon_mqa": ("falcon", FALCON_MULTI_QUERY)}
    folders = []
    for name, (arch, config) in configs.items():
        folder = save_tiny_model(tmp_path / name, arch, seed=3, **config)
        path = folder / "model.safetensors"
        save_file({k: t.to(torch.bfloat16) for k, t in load_file(path).items()}, path, metadata={"format": "pt"})
        folders.append(str(folder))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    run = subprocess.run([sys.executable, "-m", "tests.worker.load_memory", "--each-rank", "2", *folders],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr
    results = [json.loads(line) for line in run.stdout.strip().splitlines() if line.startswith("{")]
    assert len(results) == 2 * len(folders)
    for got in results:
        assert got["largest_slice"] <= got["largest_tensor"] // 2, got
        assert got["shard"] <= got["peak"] <= got["shard"] + got["largest_slice"] + SLACK, got
