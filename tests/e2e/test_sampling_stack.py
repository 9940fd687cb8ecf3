"""Sampling features through the real stack (redis-server, scheduler, worker, gateway processes and
a real gRPC client): logprobs, prompt logprobs, penalties and logit_bias give what the offline LLM
gives; stop reasons arrive; invalid values get INVALID_ARGUMENT naming the field."""

from __future__ import annotations

import grpc
import pytest

from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.services.common.pb import generate_pb2 as gen
from tests.e2e.test_stack import assert_all_blocks_free, stream

pytestmark = [pytest.mark.e2e, pytest.mark.model]

PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox"
TOL = 1e-4


@pytest.fixture(scope="module")
def offline(default_llm):
    return default_llm


def test_logprobs_penalties_and_bias_equal_the_offline_llm(stack, offline):
    bias_token = offline.tokenizer.encode_prompt(" cat")[-1]
    fields = dict(max_tokens=12, temperature=0.0, logprobs=5, prompt_logprobs=2, repetition_penalty=1.2,
                  frequency_penalty=0.5, logit_bias={bias_token: 5.0})
    expected = offline.generate(PROMPT, SamplingParams(**fields))[0]
    responses = stream(stack.gateway, gen.GenerateRequest(prompt=PROMPT, sampling_params=gen.SamplingParams(**fields)))
    token_ids = [t for r in responses for t in r.token_ids]
    entries = [e for r in responses for e in r.logprobs]
    assert token_ids == list(expected.token_ids) and len(entries) == len(token_ids)
    for got, want in zip(entries, expected.samples[0].logprobs):
        assert got.token_id == want.token_id and got.rank == want.rank
        assert abs(got.logprob - want.logprob) < TOL
        assert list(got.top_token_ids) == list(want.top_token_ids)
        assert all(abs(a - b) < TOL for a, b in zip(got.top_logprobs, want.top_logprobs))
    assert responses[0].HasField("prompt_logprobs") and not any(r.HasField("prompt_logprobs") for r in responses[1:])
    prompt = responses[0].prompt_logprobs.positions
    assert len(prompt) == len(expected.prompt_token_ids) - 1
    for got, want in zip(prompt, expected.prompt_logprobs[1:]):
        assert got.token_id == want.token_id and abs(got.logprob - want.logprob) < TOL
        assert list(got.top_token_ids) == list(want.top_token_ids)
    plain = stream(stack.gateway, gen.GenerateRequest(prompt=PROMPT, sampling_params=gen.SamplingParams(
        max_tokens=12, temperature=0.0)))
    assert [t for r in plain for t in r.token_ids] != token_ids  # the penalties and the bias changed the output
    assert not any(r.logprobs for r in plain)
    assert_all_blocks_free(stack)


def test_stop_reasons(stack, offline):
    free = offline.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    index = next(i for i in range(1, len(free.token_ids)) if free.token_ids[i] not in free.token_ids[:i])
    by_token = stream(stack.gateway, gen.GenerateRequest(prompt=PROMPT, sampling_params=gen.SamplingParams(
        max_tokens=8, temperature=0.0, stop_token_ids=[free.token_ids[index]])))
    assert by_token[-1].WhichOneof("stop_reason") == "stop_token_id"
    assert by_token[-1].stop_token_id == free.token_ids[index]
    word = free.text.split()[1]
    by_string = stream(stack.gateway, gen.GenerateRequest(prompt=PROMPT, sampling_params=gen.SamplingParams(
        max_tokens=8, temperature=0.0, stop=[word])))
    assert by_string[-1].finish_reason == gen.FINISH_REASON_STOP and by_string[-1].stop_string == word
    assert_all_blocks_free(stack)


def test_allowed_token_ids_and_bad_words_as_the_offline_llm_does(stack, offline):
    """allowed_token_ids = the greedy output's own tokens leaves it unchanged; a bad word taken from
    the greedy output never appears (as a token sequence) while it would without; gRPC and LLM agree."""
    fields = dict(max_tokens=12, temperature=0.0, ignore_eos=True)
    greedy = offline.generate(PROMPT, SamplingParams(**fields))[0]
    kept = stream(stack.gateway, gen.GenerateRequest(prompt=PROMPT, sampling_params=gen.SamplingParams(
        allowed_token_ids=sorted(set(greedy.token_ids)), **fields)))
    assert [t for r in kept for t in r.token_ids] == list(greedy.token_ids)
    word = greedy.text.split()[1]
    banned = offline.generate(PROMPT, SamplingParams(bad_words=(word,), **fields))[0]
    served = stream(stack.gateway, gen.GenerateRequest(prompt=PROMPT, sampling_params=gen.SamplingParams(
        bad_words=[word], **fields)))
    assert [t for r in served for t in r.token_ids] == list(banned.token_ids) != list(greedy.token_ids)
    encode = offline.tokenizer.hf_tokenizer.encode
    for sequence in (encode(word, add_special_tokens=False), encode(" " + word, add_special_tokens=False)):
        ids = list(banned.token_ids)
        assert not any(ids[i:i + len(sequence)] == sequence for i in range(len(ids)))
    assert_all_blocks_free(stack)


BAD = [
    (dict(logprobs=21), "sampling_params.logprobs"),
    (dict(prompt_logprobs=-1), "sampling_params.prompt_logprobs"),
    (dict(presence_penalty=2.5), "sampling_params.presence_penalty"),
    (dict(frequency_penalty=-2.5), "sampling_params.frequency_penalty"),
    (dict(repetition_penalty=0.0), "sampling_params.repetition_penalty"),
    (dict(logit_bias={5: 150.0}), "sampling_params.logit_bias[5]"),
    (dict(logit_bias={49152: 1.0}), "sampling_params.logit_bias[49152]"),
    (dict(logit_bias={i: 1.0 for i in range(301)}), "sampling_params.logit_bias"),
    (dict(n=2, best_of=3), "sampling_params.best_of"),
    (dict(allowed_token_ids=[5, 49152]), "sampling_params.allowed_token_ids[1]"),
]


@pytest.mark.parametrize("fields,field", BAD, ids=[b[1] + str(i) for i, b in enumerate(BAD)])
def test_invalid_sampling_values_are_invalid_argument(stack, fields, field):
    with pytest.raises(grpc.RpcError) as info:
        stream(stack.gateway, gen.GenerateRequest(prompt="Hi", sampling_params=gen.SamplingParams(max_tokens=4, **fields)))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(field + ":"), info.value.details()


def test_stack_keeps_serving_after_invalid_sampling_values(stack):
    responses = stream(stack.gateway, gen.GenerateRequest(prompt="Hi", sampling_params=gen.SamplingParams(
        max_tokens=4, temperature=0.0, best_of=1, logprobs=0)))
    assert responses[-1].finish_reason and all(len(r.logprobs) == len(r.token_ids) for r in responses)
    assert_all_blocks_free(stack)
