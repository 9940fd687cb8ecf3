"""`pagedserve bench pipeline-parallel` on a tiny Llama: every configuration (one step loop, or one
per virtual engine) makes all its tokens, and the stages' idle fractions are reported for P > 1 only."""

from __future__ import annotations

import argparse
import json

from pagedserve.bench import pipeline_parallel
from tests.worker.tiny_models import save_tiny_model, save_tiny_tokenizer


def test_pipeline_bench_reports_tokens_and_idle_fractions(tmp_path, capsys):
    folder = save_tiny_tokenizer(save_tiny_model(tmp_path / "m", "llama", seed=3))
    out = tmp_path / "pp.json"
    args = argparse.Namespace(model=str(folder), configs="1:1,2:2,2:2i", num_prompts=3, max_tokens=4,
                              kv_cache_memory="1MiB", result_json=out)
    assert pipeline_parallel.main(args) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [(r["pipeline_parallel_size"], r["virtual_engines"], r["step_loops"], r["output_tokens"])
            for r in runs] == [(1, 1, "one", 12), (2, 2, "one", 12), (2, 2, "per engine", 12)]
    assert runs[0]["bubble"] is None
    for run in runs[1:]:
        assert len(run["idle_fraction_per_rank"]) == 2
        assert all(0.0 <= x <= 1.0 for x in run["idle_fraction_per_rank"])
    assert "Pipeline parallel" in capsys.readouterr().out
