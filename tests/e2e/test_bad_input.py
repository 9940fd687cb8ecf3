"""Bad input gets INVALID_ARGUMENT naming the field; the stack keeps serving and leaks no block."""

from __future__ import annotations

import grpc
import pytest

from services.common.pb import generate_pb2 as gen
from services.common.pb import generate_pb2_grpc
from tests.e2e.test_stack import QUESTIONS, assert_all_blocks_free, chat_request, stream

pytestmark = [pytest.mark.e2e, pytest.mark.model]


def prompt_request(prompt: str, **sampling) -> gen.GenerateRequest:
    return gen.GenerateRequest(prompt=prompt, sampling_params=gen.SamplingParams(**sampling))


def chat_with_role(role: str) -> gen.GenerateRequest:
    request = gen.GenerateRequest(sampling_params=gen.SamplingParams(max_tokens=4))
    request.chat.messages.add(role=role, content="hello")
    return request


def token_ids(ids: list[int]) -> gen.GenerateRequest:
    return gen.GenerateRequest(prompt_token_ids=gen.TokenIds(ids=ids), sampling_params=gen.SamplingParams(max_tokens=4))


BAD_REQUESTS = [
    ("empty prompt", prompt_request(""), "prompt"),
    ("no prompt at all", gen.GenerateRequest(), "prompt"),
    ("prompt longer than the context", prompt_request("hello " * 9000), "prompt"),
    ("max_tokens 0", prompt_request("Hi", max_tokens=0), "sampling_params.max_tokens"),
    ("max_tokens negative", prompt_request("Hi", max_tokens=-5), "sampling_params.max_tokens"),
    ("max_tokens beyond the context", prompt_request("Hi", max_tokens=9000), "sampling_params.max_tokens"),
    ("temperature < 0", prompt_request("Hi", temperature=-0.5), "sampling_params.temperature"),
    ("top_p 0", prompt_request("Hi", top_p=0.0), "sampling_params.top_p"),
    ("top_p > 1", prompt_request("Hi", top_p=1.5), "sampling_params.top_p"),
    ("top_k < -1", prompt_request("Hi", top_k=-2), "sampling_params.top_k"),
    ("min_p > 1", prompt_request("Hi", min_p=2.0), "sampling_params.min_p"),
    ("unknown chat role", chat_with_role("wizard"), "chat.messages[0].role"),
    ("empty chat", gen.GenerateRequest(chat=gen.ChatMessages()), "chat.messages"),
    ("negative token id", token_ids([1, -1]), "prompt_token_ids.ids[1]"),
    ("token id beyond the vocabulary", token_ids([49152]), "prompt_token_ids.ids[0]"),
    ("empty token ids", gen.GenerateRequest(prompt_token_ids=gen.TokenIds()), "prompt_token_ids.ids"),
    ("stop token id beyond the vocabulary", prompt_request("Hi", stop_token_ids=[10**6]), "sampling_params.stop_token_ids[0]"),
]


@pytest.mark.parametrize("name,request_,field", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_input_is_invalid_argument_naming_the_field(stack, name, request_, field):
    with pytest.raises(grpc.RpcError) as info:
        stream(stack.gateway, request_)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(field + ":"), info.value.details()


def test_stack_keeps_serving_after_bad_input(stack):
    responses = stream(stack.gateway, chat_request(QUESTIONS[3], max_tokens=8))
    assert responses[-1].finish_reason and "".join(r.text for r in responses)
    assert_all_blocks_free(stack)


def test_prompt_larger_than_any_worker_is_resource_exhausted(stack):
    # 64 MiB of KV per worker holds 91 blocks = 1,456 tokens; the context (8,192) allows this prompt.
    with pytest.raises(grpc.RpcError) as info:
        stream(stack.gateway, prompt_request("Tell me a long story. " * 400, max_tokens=4))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert_all_blocks_free(stack)


def test_cancelled_stream_aborts_the_request_and_frees_its_blocks(stack):
    request = chat_request(QUESTIONS[5], max_tokens=500, ignore_eos=True)
    with grpc.insecure_channel(stack.gateway) as channel:
        call = generate_pb2_grpc.GenerationStub(channel).Generate(request, timeout=300)
        received = [next(call) for _ in range(3)]
        call.cancel()
    assert all(not r.finish_reason for r in received)
    assert_all_blocks_free(stack)


def test_stop_string_ends_the_request_and_frees_its_blocks(stack, offline_outputs):
    expected = offline_outputs[QUESTIONS[0]].text
    assert "Paris" in expected
    responses = stream(stack.gateway, chat_request(QUESTIONS[0], max_tokens=24, stop=["Paris"]))
    assert "".join(r.text for r in responses) == expected[: expected.index("Paris")]
    assert responses[-1].finish_reason == gen.FINISH_REASON_STOP
    included = stream(stack.gateway, chat_request(QUESTIONS[0], max_tokens=24, stop=["Paris"],
                                                  include_stop_str_in_output=True))
    assert "".join(r.text for r in included) == expected[: expected.index("Paris") + len("Paris")]
    assert_all_blocks_free(stack)
