"""Pipeline parallelism: stage layouts, checkpoint names per stage, and PP=2 / T x P = 2 x 2 logits
equal to one rank's."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as tmp

from pagedserve.engine.parallel.pipeline import (PipelineError, RankPosition, pipeline_stage,
                                                 stage_checkpoint_name)
from pagedserve.engine.parallel.rank import check_shardable
from pagedserve.engine.weight_loader import load_model
from pagedserve.llm import LLM
from tests.worker.tiny_models import save_tiny_model, save_tiny_tokenizer
from tests.worker.tp_helpers import grid_rank_main, parent_rendezvous, two_steps

CASES = {  # (T, P), model overrides
    "pp2": ((1, 2), dict()),
    "tp2xpp2_three_layers_tied_odd_vocab": ((2, 2), dict(num_hidden_layers=3, vocab_size=95,
                                                         tie_word_embeddings=True)),
}


def test_stages_split_layers_consecutively_first_stages_one_more():
    stages = [pipeline_stage(7, s, 3) for s in range(3)]
    assert [(s.first_layer, s.num_layers) for s in stages] == [(0, 3), (3, 2), (5, 2)]
    assert {s.max_stage_layers for s in stages} == {3}
    assert (stages[0].is_first, stages[2].is_last, stages[1].is_last) == (True, True, False)
    with pytest.raises(PipelineError, match="between 1 and the model's 2 layers"):
        pipeline_stage(2, 0, 3)


def test_each_stage_gets_its_layers_renamed_and_the_ends():
    first, last = pipeline_stage(4, 0, 2), pipeline_stage(4, 1, 2)
    assert stage_checkpoint_name("model.layers.3.mlp.down_proj.weight", last, False) == "model.layers.1.mlp.down_proj.weight"
    assert stage_checkpoint_name("model.layers.3.mlp.down_proj.weight", first, False) is None
    assert stage_checkpoint_name("model.embed_tokens.weight", first, False) == "model.embed_tokens.weight"
    assert stage_checkpoint_name("model.embed_tokens.weight", last, False) is None
    assert stage_checkpoint_name("model.embed_tokens.weight", last, True) == "model.embed_tokens.weight"
    assert stage_checkpoint_name("model.norm.weight", first, False) is None
    assert stage_checkpoint_name("lm_head.weight", last, False) == "lm_head.weight"
    gpt2 = dict(layer_lists=("h",), embeddings=("wte",), first_only=("wpe",))  # GPT-2's names
    assert (stage_checkpoint_name("transformer.h.3.attn.c_attn.weight", last, True, **gpt2)
            == "transformer.h.1.attn.c_attn.weight")
    assert stage_checkpoint_name("h.1.attn.c_attn.weight", first, True, **gpt2) == "h.1.attn.c_attn.weight"
    assert stage_checkpoint_name("transformer.wpe.weight", first, True, **gpt2) == "transformer.wpe.weight"
    assert stage_checkpoint_name("transformer.wpe.weight", last, True, **gpt2) is None
    assert stage_checkpoint_name("transformer.wte.weight", last, True, **gpt2) == "transformer.wte.weight"
    assert stage_checkpoint_name("transformer.ln_f.weight", first, True, **gpt2) is None


def test_rank_grid_layout():
    positions = [RankPosition(r, 2, 3) for r in range(6)]
    assert [(p.stage, p.tp_rank) for p in positions] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert positions[0].last_stage_leader == 4
    assert positions[0].stage_ranks() == [(0, 1), (2, 3), (4, 5)]


def test_unsupported_combinations_are_refused(tmp_path):
    folder = save_tiny_model(tmp_path / "m", "llama")  # 2 layers
    with pytest.raises(PipelineError, match="use fewer stages"):
        check_shardable(folder, 1, 3)
    with pytest.raises(ValueError, match="virtual_engines=2: give 1, or more than 1 with pipeline_parallel_size > 1"):
        LLM(save_tiny_tokenizer(folder), virtual_engines=2)


@pytest.mark.parametrize("case", sorted(CASES))
def test_pipeline_logits_equal_one_rank(tmp_path, case):
    (t, p), overrides = CASES[case]
    folder = save_tiny_model(tmp_path / "m", "llama", seed=5, **overrides)
    reference = two_steps(load_model(folder))
    out = tmp_path / "logits.pt"
    spec, _store = parent_rendezvous(t * p)
    tmp.spawn(grid_rank_main, args=(str(folder), spec, (t, p), str(out)), nprocs=t * p)
    ours = torch.load(out)
    for got, want in zip(ours, reference, strict=True):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)  # float32 sums in another order (1.7e-5 seen)
