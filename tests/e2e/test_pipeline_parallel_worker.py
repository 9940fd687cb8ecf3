"""`pagedserve worker --pipeline-parallel-size 2` in the whole stack (tiny Llama): two virtual
engines registered as workers ``worker-0/ve0`` and ``/ve1``, speculating with n-gram drafts or with
the model as its own draft model (the first stage drafts and passes the drafts on), the same greedy
tokens as the in-process one-rank engine (drafts accepted), twice the KV capacity of one rank's budget
in all (each rank caches 1 of the 2 layers; half of it per virtual engine), a third of it beside the
draft's cache (both layers, on every rank's count), and a killed last-stage rank makes the scheduler
drop both virtual engines and the worker exit non-zero (no hang)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.llm import LLM
from tests.e2e.processes import scheduler_stats, start_stack
from tests.e2e.test_metrics import scrape, total
from tests.e2e.test_tensor_parallel_worker import kill_a_rank_and_expect_the_drop
from tests.worker.tiny_models import save_tiny_model, save_tiny_tokenizer

PROMPTS = ["t5 t9 t33 t2", "t40 t41 t42 t43 t44 t45 t46 t47 t48", "t90"]
NGRAM = ("--speculative-method", "ngram", "--speculative-control", "fixed", "--num-speculative-tokens", "3",
         "--prompt-lookup-max", "2")
"""Speculation over the stages: the first stage drafts, the last stage verifies."""
LAYER_BLOCK_BYTES = 2 * 16 * 2 * 16 * 4
"""K and V of one 16-token block of one layer of the tiny model (2 KV heads of 16), float32."""


def _complete(target: str, prompt: str, env: dict) -> dict:
    out = subprocess.run([sys.executable, "-m", "pagedserve", "complete", "--target", target, "--prompt", prompt,
                          "--json", "--temperature", "0", "--max-tokens", "8", "--ignore-eos", "--timeout", "60"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


pytestmark = [pytest.mark.e2e]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_tokenizer(save_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", seed=7))


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_pp2_worker_in_the_stack(tmp_path, tiny, method):
    reference = LLM(tiny, kv_cache_memory="4MiB").generate(
        PROMPTS, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    speculative = NGRAM if method == "ngram" else ("--speculative-method", "draft_model", "--speculative-control",
                                                   "fixed", "--num-speculative-tokens", "3", "--speculative-model",
                                                   str(tiny))
    stack = start_stack(tmp_path, tiny, num_workers=1, kv_cache_memory="4MiB",
                        worker_args=("--pipeline-parallel-size", "2", *speculative),
                        scheduler_args=("--step-timeout", "30", *speculative), workers_per_process=2)
    try:
        # One rank's 4 MiB holds blocks of its 1 layer, half for each virtual engine: in all, twice
        # the blocks of one rank with both layers; with the draft's 2 layers beside each block, a third.
        layers = 1 if method == "ngram" else 3
        workers = sorted((w.worker_id, w.num_blocks) for w in scheduler_stats(stack.scheduler).workers)
        assert workers == [(f"worker-0/ve{i}", (4 << 20) // (2 * layers * LAYER_BLOCK_BYTES)) for i in range(2)]
        for prompt, want in zip(PROMPTS, reference):
            assert _complete(stack.gateway, prompt, stack.env)["token_ids"] == list(want.token_ids)
        metrics = scrape(stack.metrics["scheduler"])
        accepted = total(metrics, "vllm:spec_decode_num_accepted_tokens_total")
        assert accepted > 0
        if method == "draft_model":  # the model as its own draft: every draft accepted
            assert accepted == total(metrics, "vllm:spec_decode_num_draft_tokens_total")
        kill_a_rank_and_expect_the_drop(stack, ("worker-0/ve0", "worker-0/ve1"))  # rank 1: the last stage
    finally:
        for p in reversed(list(stack.processes.values())):
            p.stop()
