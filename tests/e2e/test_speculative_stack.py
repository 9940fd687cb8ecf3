"""Speculative decoding through the real services: a scheduler and a worker started with the same
n-gram flags, or draft-model flags, give, greedy with n = 2, exactly the in-process engine's output
without speculation, on a prompt that copies its input and on a plain one; the scheduler's /metrics
counts accepted drafts (and the gateway's HTTP /metrics the same, from GetStats; every draft when the
draft model is the target itself), and every KV block is free afterwards (the slots reserved for
rejected drafts included)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from pagedserve.engine.sampling_params import SamplingParams
from services.common.pb import generate_pb2 as gen
from tests.e2e.processes import start_stack
from tests.e2e.test_metrics import scrape, total
from tests.e2e.test_stack import assert_all_blocks_free, stream
from tests.engine.conftest import BASE_PROMPTS
from tests.engine.test_speculative_decoding import COPY_PROMPT

pytestmark = [pytest.mark.e2e, pytest.mark.model]

SPECULATIVE = ("--speculative-method", "ngram", "--num-speculative-tokens", "4", "--prompt-lookup-max", "3")
"""The same flags for the scheduler (which reserves the slots) and the worker (which drafts into them)."""

MAX_TOKENS = 32


def samples_by_index(responses: list[gen.GenerateResponse]) -> list[tuple[int, ...]]:
    """The token ids of each sample of one streamed request, by sample index."""
    by_index: dict[int, list[int]] = {}
    for r in responses:
        by_index.setdefault(r.index, []).extend(r.token_ids)
    return [tuple(by_index[i]) for i in sorted(by_index)]


def plain_greedy_through_the_stack(tmp_path, default_model, default_llm, flags: tuple[str, ...]) -> tuple[dict, dict]:
    """Streams the two prompts (greedy, n = 2) through a stack whose scheduler and worker take ``flags``,
    asserts the in-process engine's tokens and all blocks free; returns the scheduler's metrics and the
    gateway's HTTP ones."""
    from pagedserve.text.tokenizer import PromptTokenizer

    tokenizer = PromptTokenizer.from_folder(default_model)
    prompts = [tokenizer.encode_prompt(p) for p in (COPY_PROMPT, BASE_PROMPTS[2])]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, n=2)
    want = [[s.token_ids for s in out.samples] for out in default_llm.generate(prompts, params)]
    requests = [gen.GenerateRequest(prompt_token_ids=gen.TokenIds(ids=p), sampling_params=gen.SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.0, n=2)) for p in prompts]
    stack = start_stack(tmp_path, default_model, num_workers=1, worker_threads=2, scheduler_args=flags,
                        worker_args=flags)
    try:
        with ThreadPoolExecutor(len(requests)) as pool:
            got = [samples_by_index(r) for r in pool.map(lambda q: stream(stack.gateway, q), requests)]
        assert got == want
        assert_all_blocks_free(stack)
        # the gateway's OpenAI port: the cluster's counts, from GetStats
        return scrape(stack.metrics["scheduler"]), scrape(stack.http.removeprefix("http://"))
    finally:
        stack.stop()


def test_speculative_stack_gives_plain_greedy_output_and_counts_accepted_drafts(tmp_path, default_model, default_llm):
    metrics, cluster = plain_greedy_through_the_stack(tmp_path, default_model, default_llm, SPECULATIVE)
    assert total(metrics, "vllm:spec_decode_num_accepted_tokens_total") > 0
    assert total(metrics, "vllm:spec_decode_num_draft_tokens_total") >= total(
        metrics, "vllm:spec_decode_num_accepted_tokens_total")
    assert total(metrics, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position="0") > 0
    for name in ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_accepted_tokens_total"):
        assert total(cluster, name) == total(metrics, name) > 0, name
    assert [total(cluster, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(p))
            for p in range(4)] == [total(metrics, "vllm:spec_decode_num_accepted_tokens_per_pos_total",
                                         position=str(p)) for p in range(4)]


def test_draft_model_stack_gives_plain_greedy_output_and_accepts_every_draft_of_the_target_itself(
        tmp_path, default_model, default_llm):
    flags = ("--speculative-method", "draft_model", "--speculative-model", str(default_model),
             "--num-speculative-tokens", "4")
    metrics, _ = plain_greedy_through_the_stack(tmp_path, default_model, default_llm, flags)
    accepted = total(metrics, "vllm:spec_decode_num_accepted_tokens_total")
    assert accepted == total(metrics, "vllm:spec_decode_num_draft_tokens_total") >= 4 * 4  # 4 samples, >= 1 step each
    assert total(metrics, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position="3") > 0
