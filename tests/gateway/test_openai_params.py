"""The OpenAI request bodies and their mapping onto SamplingParams (no model, no processes)."""

from __future__ import annotations

import pydantic
import pytest

from pagedserve.engine.sampling_params import InvalidRequestError, SamplingParams
from pagedserve.text.chat_encoding import ChatPromptMode
from services.gateway.openai_chat import chat_prompt_mode
from services.gateway.openai_errors import _param_of
from services.gateway.openai_params import sampling_params_from_openai
from services.gateway.openai_protocol import ChatCompletionRequest, CompletionRequest


def completion(**fields) -> CompletionRequest:
    return CompletionRequest(model="m", prompt="Hi", **fields)


def test_every_field_is_mapped():
    body = ChatCompletionRequest(
        model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=5, max_completion_tokens=7,
        temperature=0.5, top_p=0.9, top_k=4, min_p=0.1, seed=3, n=2, stop="x", stop_token_ids=[5], ignore_eos=True,
        min_tokens=2, include_stop_str_in_output=True, skip_special_tokens=False, user="someone")
    assert sampling_params_from_openai(body) == SamplingParams(
        max_tokens=7, temperature=0.5, top_p=0.9, top_k=4, min_p=0.1, seed=3, min_tokens=2, stop=("x",),
        stop_token_ids=(5,), ignore_eos=True, include_stop_str_in_output=True, skip_special_tokens=False, n=2)


def test_defaults_are_the_engine_defaults_but_max_tokens_16_for_completions():
    assert sampling_params_from_openai(completion()) == SamplingParams(max_tokens=16)
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "Hi"}])
    assert sampling_params_from_openai(chat) == SamplingParams()


@pytest.mark.parametrize("fields, param", [
    ({"temperature": -1.0}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"n": 0}, "n"),
    ({"stop": ["ok", ""]}, "stop"), ({"min_tokens": 20, "max_tokens": 5}, "min_tokens"),
    ({"logprobs": 1}, "logprobs"), ({"echo": True}, "echo"), ({"best_of": 3}, "best_of"),
    ({"frequency_penalty": 0.1}, "frequency_penalty"), ({"repetition_penalty": 1.2}, "repetition_penalty"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias"), ({"spaces_between_special_tokens": False}, "spaces_between_special_tokens"),
])
def test_bad_or_unsupported_values_name_the_openai_field(fields, param):
    with pytest.raises(InvalidRequestError) as info:
        sampling_params_from_openai(completion(**fields))
    assert info.value.field_name == param


def test_defaults_of_unsupported_fields_are_accepted():
    sampling_params_from_openai(completion(best_of=1, logit_bias={}, presence_penalty=0, repetition_penalty=1))


def test_bounds_are_enforced_by_the_models():
    with pytest.raises(pydantic.ValidationError):
        completion(stop=["x"] * 65)
    with pytest.raises(pydantic.ValidationError):
        CompletionRequest(model="m", prompt=["a"] * 65)
    with pytest.raises(pydantic.ValidationError):
        completion(max_tokens="5")  # strict: no string-to-int coercion


def test_prompt_forms():
    assert CompletionRequest(model="m", prompt=[1, 2]).prompt == [1, 2]
    assert CompletionRequest(model="m", prompt=[[1], [2, 3]]).prompt == [[1], [2, 3]]
    assert CompletionRequest(model="m", prompt=["a", "b"]).prompt == ["a", "b"]


def test_chat_prompt_modes():
    assert chat_prompt_mode(True, False) is ChatPromptMode.OPEN_ASSISTANT_TURN
    assert chat_prompt_mode(False, False) is ChatPromptMode.NO_GENERATION_PROMPT
    assert chat_prompt_mode(False, True) is ChatPromptMode.CONTINUE_FINAL_MESSAGE
    with pytest.raises(InvalidRequestError):
        chat_prompt_mode(True, True)


def test_validation_error_locations_become_param_names():
    assert _param_of(("body", "messages", 0, "content")) == "messages[0].content"
    assert _param_of(("body", "prompt", "str")) == "prompt"
    assert _param_of(("body", "stop", "list[str]", 3)) == "stop[3]"
    assert _param_of(("body", "prompt", "constrained-str")) == "prompt"
    assert _param_of(("body", "stop", "function-after[x]", "constrained-str")) == "stop"
