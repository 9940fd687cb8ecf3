"""Tensor and pipeline parallelism for every architecture besides Llama (GPT-NeoX, Falcon's three
fused-QKV layouts and ALiBi, GPT-2, Mixtral, Qwen3): T=2 and P=2 logits equal one rank's within
1e-5, greedy tokens equal one rank's with preemption and prefix caching, the fused-QKV slices of
each Falcon layout, and refusals that name the sizes that work."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as tmp

from pagedserve.engine.kv_cache import KVCacheSpec
from pagedserve.engine.models.registry import load_model_config
from pagedserve.engine.parallel.rank import check_shardable
from pagedserve.engine.parallel.sharding import ShardingError, grouped_qkv_slice, shard_layout
from pagedserve.engine.weight_loader import load_model
from pagedserve.llm import LLM
from tests.worker.tiny_models import TINY_MIXTRAL, save_tiny_model
from tests.worker.tp_helpers import (BLOCK, NUM_BLOCKS, generated_tokens, parent_rendezvous,
                                     split_two_ways_main, tiny_model_and_prompts, two_steps)

_RW = {"alibi": True, "new_decoder_architecture": False, "multi_query": False, "num_kv_heads": 4,
       "parallel_attn": False, "bias": True}  # falcon-rw: [H, 3, D] rows, sequential block, biases
CASES = {  # name -> (arch, config overrides)
    "gpt_neox": ("gpt_neox", {}),  # parallel residual, 25% rotary, untied embed_out
    "gpt_neox_sequential_tied": ("gpt_neox", {"use_parallel_residual": False, "tie_word_embeddings": True}),
    "falcon_gqa": ("falcon", {}),  # new decoder architecture, 2 KV heads: one per rank
    "falcon_mqa_rotary": ("falcon", {"new_decoder_architecture": False, "multi_query": True, "parallel_attn": True,
                                     "bias": False}),
    # ALiBi over 6 heads (slopes not powers of two; rank 1 has heads 3-5), multi-query: the KV head replicated
    "falcon_alibi_mqa_6_heads": ("falcon", {"alibi": True, "new_decoder_architecture": False, "multi_query": True,
                                            "parallel_attn": True, "bias": False, "num_attention_heads": 6,
                                            "hidden_size": 96}),
    "falcon_rw_alibi_untied": ("falcon", {**_RW, "tie_word_embeddings": False}),
    "gpt2": ("gpt2", {}),  # tied, learned positions
    "mixtral": ("mixtral", TINY_MIXTRAL),
    "qwen3": ("qwen3", {}),
}
GREEDY_CASES = ["gpt_neox", "falcon_gqa", "falcon_alibi_mqa_6_heads", "gpt2", "mixtral", "qwen3"]
PROMPT_LENGTHS = (1, 4, 7, 13, 20, 31, 5, 9, 26, 2)


def _backends(name: str) -> tuple[str, ...]:
    """ALiBi models also run the C++ decode op (its slopes are the rank's heads')."""
    return ("torch", "cpu") if "alibi" in name else ("torch",)


def test_t2_and_p2_logits_equal_one_rank(tmp_path):
    """One pair of rank processes runs every case: its T=2 shard, then its P=2 stage."""
    folders = {name: save_tiny_model(tmp_path / name, arch, seed=5, **overrides)
               for name, (arch, overrides) in CASES.items()}
    cases = {name: (str(folder), _backends(name)) for name, folder in folders.items()}
    spec, _store = parent_rendezvous(2)
    tmp.spawn(split_two_ways_main, args=(cases, spec, str(tmp_path)), nprocs=2)
    for name, folder in folders.items():
        model = load_model(folder)
        for backend in _backends(name):
            reference = two_steps(model, backend)
            for split in ("tp", "pp"):
                ours = torch.load(tmp_path / f"{name}.{split}.pt")[backend]
                for got, want in zip(ours, reference, strict=True):
                    assert got.shape == want.shape
                    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5,  # float32 sums in another order
                                               msg=lambda m: f"{name} {split} {backend}: {m}")


def _kv_memory(folder, t: int, p: int) -> int:
    """Bytes a rank needs for ``NUM_BLOCKS`` blocks of its heads and layers."""
    c = load_model_config(folder)
    spec = KVCacheSpec(-(-c.num_layers // p), max(c.num_kv_heads // t, 1), c.head_dim, BLOCK, torch.float32)
    return NUM_BLOCKS * spec.bytes_per_block


@pytest.mark.parametrize("name", GREEDY_CASES)
def test_t2_and_p2_greedy_equal_one_rank_with_prefix_caching_and_preemption(tmp_path, name):
    arch, overrides = CASES[name]
    folder, prompts = tiny_model_and_prompts(tmp_path / name, PROMPT_LENGTHS, arch, **overrides)
    single = LLM(folder, kv_cache_memory=_kv_memory(folder, 1, 1), block_size=BLOCK)
    reference = [generated_tokens(single, prompts) for _ in range(2)]  # the second round hits the prefix cache
    for t, p in ((2, 1), (1, 2)):
        with LLM(folder, kv_cache_memory=_kv_memory(folder, t, p), block_size=BLOCK, tensor_parallel_size=t,
                 pipeline_parallel_size=p, virtual_engines=1) as llm:
            assert llm.stats().workers[0].num_blocks == NUM_BLOCKS
            assert [generated_tokens(llm, prompts) for _ in range(2)] == reference, (t, p)
            stats = llm.stats()
            assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0, (t, p)


def _labelled_qkv(heads: int, kv_heads: int, dim: int) -> list[tuple[str, int, int]]:
    """The rows of a fused QKV grouped by KV head, ``[Hkv, H/Hkv + 2, D]``, as (kind, head, channel)."""
    group = heads // kv_heads
    rows = []
    for g in range(kv_heads):
        rows += [("q", g * group + j, c) for j in range(group) for c in range(dim)]
        rows += [(kind, g, c) for kind in ("k", "v") for c in range(dim)]
    return rows


@pytest.mark.parametrize("heads,kv_heads,t", [(8, 4, 2), (8, 2, 4), (8, 1, 4), (8, 8, 2), (4, 2, 4)],
                         ids=["split", "replicated", "multi_query", "interleaved", "one_head_each"])
def test_grouped_qkv_slice_holds_the_ranks_heads_in_the_grouped_layout(heads, kv_heads, t):
    """Every Falcon layout (and GPT-NeoX's [H, 3, D]): each rank reads its query heads and the KV head
    they attend with, in the grouped layout of its own counts (which the model then re-lays out)."""
    from types import SimpleNamespace

    dim = 2
    config = SimpleNamespace(architecture="FalconForCausalLM", num_heads=heads, num_kv_heads=kv_heads, head_dim=dim,
                             intermediate_size=8 * t, vocab_size=10)
    rows = _labelled_qkv(heads, kv_heads, dim)
    for rank in range(t):
        layout = shard_layout(config, rank, t)
        piece = grouped_qkv_slice(layout)
        got = [row for start, stop in piece.ranges for row in rows[start:stop]]
        assert len(got) == piece.size
        first = rank * heads // t
        kv_first = first // (heads // kv_heads)
        want_kv = list(range(kv_first, kv_first + layout.num_kv_heads))
        assert got == [row for row in _labelled_qkv(heads, kv_heads, dim)
                       if (row[0] == "q" and first <= row[1] < first + heads // t)
                       or (row[0] != "q" and row[1] in want_kv)]


def test_unsplittable_sizes_are_refused_with_the_sizes_that_work(tmp_path):
    gpt2 = save_tiny_model(tmp_path / "g", "gpt2")  # 4 heads, MLP 96
    with pytest.raises(ShardingError, match="GPT2LMHeadModel cannot run with tensor_parallel_size 3: its 4 attention "
                                            "heads do not divide by 3; tensor_parallel_size 1, 2, 4 work"):
        check_shardable(gpt2, 3)
    falcon = save_tiny_model(tmp_path / "f", "falcon", num_attention_heads=6, num_kv_heads=3, hidden_size=96)
    with pytest.raises(ShardingError, match="its 3 KV heads cannot be split over 2 ranks; "
                                            "tensor_parallel_size 1, 3, 6 work"):
        check_shardable(falcon, 2)
    with pytest.raises(ValueError, match="between 1 and the model's 2 layers"):
        check_shardable(gpt2, 1, 3)


def test_mixtral_fused_expert_layout_shards_like_the_per_expert_one(tmp_path):
    """transformers 5.x's fused ``mlp.experts.gate_up_proj`` [E, 2I, H] / ``down_proj`` [E, H, I]:
    each rank reads its rows of both halves and its columns, equal to its per-expert w1/w3/w2 slices."""
    import shutil

    from safetensors.torch import save_file

    from pagedserve.engine.models.mixtral import MixtralForCausalLM
    from tests.worker.load_memory import LoadOnlyRank
    from tests.worker.tiny_models import hf_model

    folder = save_tiny_model(tmp_path / "per_expert", "mixtral", seed=3, **TINY_MIXTRAL)
    fused_folder = tmp_path / "fused"
    fused_folder.mkdir()
    shutil.copy(folder / "config.json", fused_folder)
    state = {n: t.contiguous() for n, t in hf_model(folder).state_dict().items()}
    assert any(n.endswith("mlp.experts.gate_up_proj") for n in state)
    save_file(state, fused_folder / "model.safetensors")
    config = load_model_config(folder)
    for rank in range(2):
        per_expert, fused = (MixtralForCausalLM(config, parallel=LoadOnlyRank(rank, 2)) for _ in range(2))
        per_expert.load_checkpoint(per_expert.rank_checkpoint(folder))
        fused.load_checkpoint(fused.rank_checkpoint(fused_folder))
        for (name, want), (_, got) in zip(per_expert.named_parameters(), fused.named_parameters(), strict=True):
            assert torch.equal(got, want), name
