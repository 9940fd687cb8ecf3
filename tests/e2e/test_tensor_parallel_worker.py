"""`pagedserve worker --tensor-parallel-size 2` in the whole stack (tiny Llama): the same greedy
tokens as the in-process TP=1 engine, twice the KV capacity of one rank's budget, and a killed
helper rank makes the scheduler drop the worker and the worker exit non-zero (no hang)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.llm import LLM
from tests.e2e.processes import scheduler_stats, start_stack, wait_until
from tests.worker.tiny_models import save_tiny_model, save_tiny_tokenizer

pytestmark = [pytest.mark.e2e]
PROMPTS = ["t5 t9 t33 t2", "t40 t41 t42 t43 t44 t45 t46 t47 t48", "t90"]


def _complete(target: str, prompt: str, env: dict) -> dict:
    out = subprocess.run([sys.executable, "-m", "pagedserve", "complete", "--target", target, "--prompt", prompt,
                          "--json", "--temperature", "0", "--max-tokens", "8", "--ignore-eos", "--timeout", "60"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def _helper_pid(worker_pid: int) -> int:
    """The spawned helper rank among the worker's children (not multiprocessing's resource tracker)."""
    children = Path(f"/proc/{worker_pid}/task/{worker_pid}/children").read_text().split()
    for pid in map(int, children):
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        if b"spawn_main" in cmdline:
            return pid
    raise AssertionError(f"no helper rank among {children}")


def kill_a_rank_and_expect_the_drop(stack, worker_ids: tuple[str, ...]) -> None:
    """Kills worker-0's (first) helper rank, sends a request, and expects the scheduler to drop every
    id of ``worker_ids`` ("a step failed") and the worker to exit non-zero, within 40 s."""
    os.kill(_helper_pid(stack.processes["worker-0"].popen.pid), signal.SIGKILL)
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "pagedserve", "complete", "--target", stack.gateway, "--prompt",
                    PROMPTS[0], "--max-tokens", "4", "--timeout", "15"], capture_output=True, env=stack.env,
                   timeout=60)
    log = stack.processes["scheduler"]
    wait_until(lambda: all(f"worker {w} dropped: a step failed" in log.log_text() for w in worker_ids),
               f"{worker_ids} dropped", 30)
    worker = stack.processes["worker-0"].popen
    wait_until(lambda: worker.poll() is not None, "the broken worker exiting", 30)
    assert worker.returncode != 0  # so that a supervisor (`pagedserve up`) restarts it
    assert time.monotonic() - started < 40


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_tokenizer(save_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", seed=7))


def test_tp2_worker_in_the_stack(tmp_path, tiny):
    reference = LLM(tiny, kv_cache_memory="4MiB").generate(
        PROMPTS, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    stack = start_stack(tmp_path, tiny, num_workers=1, kv_cache_memory="4MiB",
                        worker_args=("--tensor-parallel-size", "2"), scheduler_args=("--step-timeout", "30"))
    try:
        # One rank's 4 MiB holds blocks of its 1 KV head: twice the blocks of TP=1 (2 KV heads).
        assert scheduler_stats(stack.scheduler).workers[0].num_blocks == 2 * (4 << 20) // (2 * 2 * 16 * 2 * 16 * 4)
        for prompt, want in zip(PROMPTS, reference):
            assert _complete(stack.gateway, prompt, stack.env)["token_ids"] == list(want.token_ids)
        kill_a_rank_and_expect_the_drop(stack, ("worker-0",))
    finally:
        for p in reversed(list(stack.processes.values())):
            p.stop()
