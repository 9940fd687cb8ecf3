"""`pagedserve worker --tensor-parallel-size 2 --local-ranks 1 --rank-address HOST:PORT` in the whole
stack, its rank 1 a `pagedserve worker-rank` process dialing in over 127.0.0.1 (one machine standing
in for two): the same greedy tokens as one rank; the remote rank killed, the scheduler drops the
worker and the worker exits non-zero."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.llm import LLM
from tests.e2e.processes import CLUSTER_TOKEN, start_stack, wait_until
from tests.worker.test_remote_ranks import rank_address, start_rank
from tests.worker.tiny_models import save_tiny_model, save_tiny_tokenizer

pytestmark = [pytest.mark.e2e]
PROMPTS = ["t5 t9 t33 t2", "t40 t41 t42 t43 t44 t45 t46 t47 t48", "t90"]


def _greedy_tokens(target: str, prompt: str, env: dict) -> list[int]:
    """8 greedy tokens of ``prompt`` through the gateway at ``target`` (`pagedserve complete --json`)."""
    out = subprocess.run([sys.executable, "-m", "pagedserve", "complete", "--target", target, "--prompt", prompt,
                          "--json", "--temperature", "0", "--max-tokens", "8", "--ignore-eos", "--timeout", "60"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])["token_ids"]


def test_tp2_worker_with_a_remote_rank_in_the_stack(tmp_path):
    tiny = save_tiny_tokenizer(save_tiny_model(tmp_path / "tiny", "llama", seed=7))
    reference = LLM(tiny, kv_cache_memory="4MiB").generate(
        PROMPTS, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    address = rank_address()
    remote = start_rank(1, address, CLUSTER_TOKEN)
    stack = None
    try:
        stack = start_stack(tmp_path, tiny, num_workers=1, kv_cache_memory="4MiB",
                            worker_args=("--tensor-parallel-size", "2", "--local-ranks", "1",
                                         "--rank-address", address), scheduler_args=("--step-timeout", "30"))
        for prompt, want in zip(PROMPTS, reference):
            assert _greedy_tokens(stack.gateway, prompt, stack.env) == list(want.token_ids)
        remote.kill()
        started = time.monotonic()
        subprocess.run([sys.executable, "-m", "pagedserve", "complete", "--target", stack.gateway, "--prompt",
                        PROMPTS[0], "--max-tokens", "4", "--timeout", "15"], capture_output=True, env=stack.env,
                       timeout=60)
        wait_until(lambda: "worker worker-0 dropped: a step failed" in stack.processes["scheduler"].log_text(),
                   "worker-0 dropped", 30)
        worker = stack.processes["worker-0"].popen
        wait_until(lambda: worker.poll() is not None, "the broken worker exiting", 30)
        assert worker.returncode != 0
        assert time.monotonic() - started < 40
    finally:
        remote.kill()
        for p in reversed(list(stack.processes.values()) if stack else []):
            p.stop()
