"""`pagedserve bench kv`: the admission simulation on hand-made workloads, and the command on a tiny set."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pagedserve.bench.kv import compare, default_kv_slots, simulate


def test_two_requests_block_size_4():
    # A: prompt 5, output 3; B: prompt 3, output 2; 4 blocks of 4 slots.
    # step 0: admit A (5 tokens, 2 blocks) and B (3 tokens, 1 block)  -> 8 used / 12 allocated
    # step 1: A 6, B 4                                                 -> 10 / 12
    # step 2: A 7, B reaches 5 = 3 + 2 and frees its block             -> 7 / 8
    # step 3: A reaches 8 and frees: nothing left.
    r = simulate([(5, 3), (3, 2)], num_blocks=4, block_size=4)
    assert (r.steps, r.max_concurrent, r.preemptions) == (3, 2, 0)
    assert r.utilization == pytest.approx(25 / 32)
    assert r.waste_pct == pytest.approx(100 * 7 / 32)


def test_contiguous_baseline_is_one_max_len_block_per_request():
    # max_model_len 8, 16 slots: both fit; allocated 16, 16, 8 over the three steps.
    paged, baseline = compare([(5, 3), (3, 2)], kv_slots=16, block_sizes=(4,), max_model_len=8)
    assert paged[0].utilization == pytest.approx(25 / 32)
    assert (baseline.block_size, baseline.num_blocks, baseline.max_concurrent) == (8, 2, 2)
    assert baseline.utilization == pytest.approx(25 / 40)
    # 8 slots: one at a time. A holds 5, 6, 7 (steps 0-2); B is admitted at step 3: 3, 4.
    _, one = compare([(5, 3), (3, 2)], kv_slots=8, block_sizes=(4,), max_model_len=8)
    assert (one.steps, one.max_concurrent) == (5, 1)
    assert one.utilization == pytest.approx(25 / 40)


def test_preemption_recomputes_the_latest_request():
    # 3 blocks of 2 slots. A: 2+4, B: 2+2.
    # step 0: A 2, B 2 (1 block each)              -> 4 / 4
    # step 1: A 3 (2nd block); B needs a block: none, B preempted -> 3 / 4
    # step 2: A 4                                   -> 4 / 4   (B needs 2 blocks, 1 free)
    # step 3: A 5 (3rd block)                       -> 5 / 6
    # step 4: A finishes; B re-admitted with 2      -> 2 / 2
    # step 5: B 3                                   -> 3 / 4;  step 6: B finishes.
    r = simulate([(2, 4), (2, 2)], num_blocks=3, block_size=2)
    assert (r.steps, r.max_concurrent, r.preemptions) == (6, 2, 1)
    assert r.utilization == pytest.approx(21 / 24)


def test_bad_workloads_are_refused():
    with pytest.raises(ValueError, match="does not fit"):
        simulate([(10, 10)], num_blocks=2, block_size=4)
    with pytest.raises(ValueError, match="max-model-len"):
        compare([(10, 10)], kv_slots=64, block_sizes=(4,), max_model_len=16)
    with pytest.raises(ValueError, match="reservation"):
        compare([(4, 4)], kv_slots=8, block_sizes=(4,), max_model_len=16)


def test_default_kv_slots_holds_16_of_the_longest_request():
    assert default_kv_slots([(100, 30), (10, 5)], max_model_len=1024, block_sizes=(8, 64)) == 16 * 192
    assert default_kv_slots([(10, 5)], max_model_len=8192, block_sizes=(8, 64)) == 8192


def _sharegpt_file(path):
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly box jolly liquor jugs".split()
    conversations = []
    for i in range(12):
        question = " ".join(words[(i + k) % len(words)] for k in range(8 + 3 * i))
        answer = " ".join(words[(2 * i + k) % len(words)] for k in range(6 + 5 * i))
        conversations.append({"id": str(i), "conversations": [{"from": "human", "value": question},
                                                              {"from": "gpt", "value": answer}]})
    path.write_text(json.dumps(conversations))
    return path


@pytest.mark.model
def test_bench_kv_command_on_eight_sharegpt_prompts(tmp_path):
    data = _sharegpt_file(tmp_path / "sharegpt.json")
    out = tmp_path / "kv.json"
    result = subprocess.run([sys.executable, "-m", "pagedserve", "bench", "kv", "--dataset-name", "sharegpt",
                             "--dataset-path", str(data), "--num-prompts", "8", "--kv-slots", "16384",
                             "--result-json", str(out)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "contiguous (8192/req)" in result.stdout
    report = json.loads(out.read_text())
    assert [r["block_size"] for r in report["rows"]] == [8, 16, 32, 64]
    for row in report["rows"]:
        assert set(row) >= {"block_size", "utilization", "waste_pct", "max_concurrent"}
        assert 0 < row["utilization"] <= 1 and row["waste_pct"] == pytest.approx(100 * (1 - row["utilization"]))
        assert row["max_concurrent"] == 8  # 16384 slots hold all 8 short requests at once
    utilizations = [r["utilization"] for r in report["rows"]]
    assert utilizations == sorted(utilizations, reverse=True)  # bigger blocks waste more
    baseline = report["baseline"]
    assert baseline["reserved_per_request"] == 8192 and baseline["max_concurrent"] == 2
    assert baseline["utilization"] < utilizations[-1]
    assert report["settings"]["kv_slots"] == 16384 and len(report["requests"]) == 8
