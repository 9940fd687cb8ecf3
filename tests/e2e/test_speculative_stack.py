"""Speculative decoding through the real services: a scheduler and a worker started with the same
n-gram flags, or draft-model flags (a worker of one rank, or of three tensor-parallel ranks), give, greedy with
n = 2, exactly the in-process engine's output without speculation, on a prompt that copies its input, on a
plain one and on a JSON copy with a schema (drafts verified under the grammar's masks); the scheduler's /metrics
counts accepted drafts (and the gateway's HTTP /metrics the same, from GetStats; every draft when the
draft model is the target itself, sampled requests' drafts included), a seeded sampled request gives the
same tokens twice, and every KV block is free afterwards (the slots reserved for rejected drafts
included)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.engine.structured_output import StructuredOutput, StructureKind
from pagedserve.llm import LLM
from pagedserve.services.common.pb import generate_pb2 as gen
from tests.conftest import save_small_model
from tests.e2e.processes import start_stack
from tests.e2e.test_metrics import scrape, total
from tests.e2e.test_stack import assert_all_blocks_free, stream
from tests.engine.conftest import BASE_PROMPTS
from tests.engine.test_speculative_decoding import COPY_PROMPT
from tests.engine.test_structured_outputs import PERSON

pytestmark = [pytest.mark.e2e, pytest.mark.model]

SPECULATIVE = ("--speculative-method", "ngram", "--speculative-control", "fixed", "--num-speculative-tokens", "4",
               "--prompt-lookup-max", "3")
"""The same flags for the scheduler (which reserves the slots) and the worker (which drafts into them)."""

MAX_TOKENS = 32
RECORD = json.dumps({"name": "Ada Lovelace", "age": 36, "color": "green", "tags": ["math", "poetry"]})


def samples_by_index(responses: list[gen.GenerateResponse]) -> list[tuple[int, ...]]:
    """The token ids of each sample of one streamed request, by sample index."""
    by_index: dict[int, list[int]] = {}
    for r in responses:
        by_index.setdefault(r.index, []).extend(r.token_ids)
    return [tuple(by_index[i]) for i in sorted(by_index)]


def greedy_requests(model, llm) -> tuple[list[gen.GenerateRequest], list[list[tuple[int, ...]]]]:
    """The two prompts (greedy, n = 2) as requests, and the in-process engine ``llm``'s tokens for them."""
    from pagedserve.text.tokenizer import PromptTokenizer

    tokenizer = PromptTokenizer.from_folder(model)
    prompts = [tokenizer.encode_prompt(p) for p in (COPY_PROMPT, BASE_PROMPTS[2])]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, n=2)
    want = [[s.token_ids for s in out.samples] for out in llm.generate(prompts, params)]
    requests = [gen.GenerateRequest(prompt_token_ids=gen.TokenIds(ids=p), sampling_params=gen.SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.0, n=2)) for p in prompts]
    return requests, want


def json_copy_request(model, llm) -> tuple[gen.GenerateRequest, list[tuple[int, ...]]]:
    """A prompt that gives a JSON record to copy, with a schema the record fits (greedy, n = 2), and the
    in-process engine ``llm``'s tokens for it: the record, whose tokens the n-gram drafts find in the prompt."""
    from pagedserve.text.tokenizer import ChatTurn, PromptTokenizer

    tokenizer = PromptTokenizer.from_folder(model)
    prompt = tokenizer.encode_chat([ChatTurn("user", f"Copy this JSON exactly: {RECORD}")])
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, n=2,
                            structured_output=StructuredOutput(StructureKind.JSON, json.dumps(PERSON)))
    want = [s.token_ids for s in llm.generate(prompt, params)[0].samples]
    assert json.loads(tokenizer.decode(want[0], True)) == json.loads(RECORD)
    structure = gen.StructuredOutput(json=json.dumps(PERSON))
    return gen.GenerateRequest(prompt_token_ids=gen.TokenIds(ids=prompt), sampling_params=gen.SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.0, n=2, structured_output=structure)), want


def through_the_stack(tmp_path, model, flags: tuple[str, ...], requests: list[gen.GenerateRequest],
                      worker_args: tuple[str, ...] = ()) -> tuple[list[list[tuple[int, ...]]], dict, dict]:
    """Streams ``requests`` at once through a stack whose scheduler and worker take ``flags`` (and the
    worker ``worker_args``), asserts all blocks free; returns each request's samples, the scheduler's
    metrics and the gateway's HTTP ones."""
    stack = start_stack(tmp_path, model, num_workers=1, worker_threads=2, scheduler_args=flags,
                        worker_args=flags + worker_args)
    try:
        with ThreadPoolExecutor(len(requests)) as pool:
            got = [samples_by_index(r) for r in pool.map(lambda q: stream(stack.gateway, q), requests)]
        assert_all_blocks_free(stack)
        # the gateway's OpenAI port: the cluster's counts, from GetStats
        return got, scrape(stack.metrics["scheduler"]), scrape(stack.http.removeprefix("http://"))
    finally:
        stack.stop()


@pytest.mark.parametrize("control", ["fixed", "goodput"])
def test_speculative_stack_gives_plain_greedy_output_and_counts_accepted_drafts(tmp_path, default_model, default_llm,
                                                                               control):
    # goodput: 4 sequences at once draft while the drafts pay for their rows (at first every slot does)
    flags = tuple(control if f == "fixed" else f for f in SPECULATIVE)
    requests, want = greedy_requests(default_model, default_llm)
    structured, structured_want = json_copy_request(default_model, default_llm)
    got, metrics, cluster = through_the_stack(tmp_path, default_model, flags, [*requests, structured])
    want.append(structured_want)
    assert got == want
    assert total(metrics, "vllm:spec_decode_num_accepted_tokens_total") > 0
    assert total(metrics, "vllm:spec_decode_num_draft_tokens_total") >= total(
        metrics, "vllm:spec_decode_num_accepted_tokens_total")
    assert total(metrics, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position="0") > 0
    for name in ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_accepted_tokens_total"):
        assert total(cluster, name) == total(metrics, name) > 0, name
    assert [total(cluster, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(p))
            for p in range(4)] == [total(metrics, "vllm:spec_decode_num_accepted_tokens_per_pos_total",
                                         position=str(p)) for p in range(4)]


def test_a_tensor_parallel_worker_speculates_with_plain_greedy_output(tmp_path, default_model):
    # 3 ranks (one KV head each): rank 0 drafts (the draft model whole, beside its shard), shares the
    # drafts, verifies and shares the outcome (n-gram takes the same path: tests/worker/test_tensor_parallel_llm.py).
    # The small model widened to 6 query heads over 3 KV heads drafts for itself (the default model, 9 over 3,
    # took 36 s of the suite): every draft is kept, so accepted drafts' K/V are checked on every rank.
    model = save_small_model(tmp_path / "small-3-kv-heads", default_model, hidden_size=96, intermediate_size=192,
                             num_attention_heads=6, num_key_value_heads=3)
    flags = ("--speculative-method", "draft_model", "--speculative-control", "fixed", "--speculative-model", str(model),
             "--num-speculative-tokens", "4")
    requests, want = greedy_requests(model, LLM(model, kv_cache_memory="64MiB"))
    got, metrics, _ = through_the_stack(tmp_path, model, flags, requests, worker_args=("--tensor-parallel-size", "3"))
    assert got == want
    accepted = total(metrics, "vllm:spec_decode_num_accepted_tokens_total")
    assert accepted == total(metrics, "vllm:spec_decode_num_draft_tokens_total") > 0


def test_draft_model_stack_gives_plain_greedy_output_and_accepts_every_draft_of_the_target_itself(
        tmp_path, small_model, small_llm):
    # and a seeded sampled request, twice: drafts drawn from the draft's q (here the target's p) are all
    # kept too, where argmax drafts would keep p(argmax) of them. The small model drafts for itself: what is checked
    # holds for any model whose draft is itself (the default model's drafts cost 23 s of the suite).
    flags = ("--speculative-method", "draft_model", "--speculative-control", "fixed", "--speculative-model",
             str(small_model), "--num-speculative-tokens", "4")
    requests, want = greedy_requests(small_model, small_llm)
    sampled = gen.GenerateRequest(prompt_token_ids=requests[1].prompt_token_ids, sampling_params=gen.SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.9, top_k=30, top_p=0.95, seed=17, frequency_penalty=0.3, ignore_eos=True))
    got, metrics, _ = through_the_stack(tmp_path, small_model, flags, [*requests, sampled, sampled])
    assert got[:2] == want
    assert got[2] == got[3] and len(got[2][0]) == MAX_TOKENS
    accepted = total(metrics, "vllm:spec_decode_num_accepted_tokens_total")
    assert accepted == total(metrics, "vllm:spec_decode_num_draft_tokens_total") >= 6 * 4  # 6 samples, >= 1 step each
    assert total(metrics, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position="3") > 0
