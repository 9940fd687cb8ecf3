"""The OpenAI request bodies and their mapping onto SamplingParams (no model, no processes)."""

from __future__ import annotations

import pydantic
import pytest

from pagedserve.engine.sampling_params import InvalidRequestError, SamplingParams
from pagedserve.engine.structured_output import StructuredOutput, StructureKind
from pagedserve.text.chat_encoding import ChatPromptMode
from pagedserve.services.gateway.openai_chat import chat_prompt_mode
from pagedserve.services.gateway.openai_errors import _param_of
from pagedserve.services.gateway.openai_params import SUPPORTED_FIELDS, sampling_params_from_openai
from pagedserve.services.gateway.openai_protocol import ChatCompletionRequest, CompletionRequest


def completion(**fields) -> CompletionRequest:
    return CompletionRequest(model="m", prompt="Hi", **fields)


def test_every_field_is_mapped():
    body = ChatCompletionRequest(
        model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=5, max_completion_tokens=7,
        temperature=0.5, top_p=0.9, top_k=4, min_p=0.1, seed=3, n=2, stop="x", stop_token_ids=[5], ignore_eos=True,
        min_tokens=2, include_stop_str_in_output=True, skip_special_tokens=False, user="someone",
        presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.3, logit_bias={"7": 2.0, " 9": -1.0},
        best_of=3, spaces_between_special_tokens=False, logprobs=True, top_logprobs=4, allowed_token_ids=[3, 4],
        bad_words=["no"])
    expected = SamplingParams(
        max_tokens=7, temperature=0.5, top_p=0.9, top_k=4, min_p=0.1, seed=3, min_tokens=2, stop=("x",),
        stop_token_ids=(5,), ignore_eos=True, include_stop_str_in_output=True, skip_special_tokens=False, n=2,
        presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.3, logit_bias={7: 2.0, 9: -1.0},
        best_of=3, spaces_between_special_tokens=False, logprobs=4, allowed_token_ids=(3, 4), bad_words=("no",))
    assert sampling_params_from_openai(body) == expected
    # a structured output refuses allowed_token_ids and bad_words beside it, so it is mapped on its own
    structured = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "Hi"}], guided_regex=r"[0-9]+")
    regex = StructuredOutput(StructureKind.REGEX, r"[0-9]+")
    assert sampling_params_from_openai(structured) == SamplingParams(structured_output=regex)
    assert sampling_params_from_openai(completion(prompt_logprobs=1)).prompt_logprobs == 1  # completions only
    defaults = SamplingParams()
    untested = [f for f in SUPPORTED_FIELDS if getattr(expected, f) == getattr(defaults, f) and f != "structured_output"]
    assert untested == ["prompt_logprobs"], "a field is not tested"
    with pytest.raises(InvalidRequestError):  # chat returns no prompt logprobs: refused rather than dropped
        sampling_params_from_openai(body.model_copy(update={"prompt_logprobs": 1}))


def test_logprobs_forms():
    assert sampling_params_from_openai(completion(logprobs=3)).logprobs == 3
    echoed = sampling_params_from_openai(completion(logprobs=2, echo=True))
    assert (echoed.logprobs, echoed.prompt_logprobs) == (2, 2)
    assert sampling_params_from_openai(completion(echo=True)).prompt_logprobs is None
    chat = dict(model="m", messages=[{"role": "user", "content": "Hi"}])
    assert sampling_params_from_openai(ChatCompletionRequest(**chat, logprobs=True)).logprobs == 0
    assert sampling_params_from_openai(ChatCompletionRequest(**chat)).logprobs is None
    for fields in ({"top_logprobs": 2}, {"logprobs": True, "top_logprobs": 21}, {"logprobs": True, "top_logprobs": -1}):
        with pytest.raises(InvalidRequestError) as info:
            sampling_params_from_openai(ChatCompletionRequest(**chat, **fields))
        assert info.value.field_name == "top_logprobs"


def test_defaults_are_the_engine_defaults_but_max_tokens_16_for_completions():
    assert sampling_params_from_openai(completion()) == SamplingParams(max_tokens=16)
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "Hi"}])
    assert sampling_params_from_openai(chat) == SamplingParams()


@pytest.mark.parametrize("fields, param", [
    ({"temperature": -1.0}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"n": 0}, "n"),
    ({"stop": ["ok", ""]}, "stop"), ({"min_tokens": 20, "max_tokens": 5}, "min_tokens"),
    ({"logprobs": 21}, "logprobs"), ({"suffix": "x"}, "suffix"), ({"best_of": 3, "n": 4}, "best_of"),
    ({"best_of": 3, "stream": True}, "best_of"), ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"), ({"logit_bias": {"abc": 1.0}}, "logit_bias"),
    ({"logit_bias": {"5": 101.0}}, "logit_bias[5]"), ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"logit_bias": {"5": 100.0, "05": -100.0}}, "logit_bias"),  # one token id twice: one bias was dropped
])
def test_bad_or_unsupported_values_name_the_openai_field(fields, param):
    with pytest.raises(InvalidRequestError) as info:
        sampling_params_from_openai(completion(**fields))
    assert info.value.field_name == param


def test_max_tokens_0_says_it_needs_echo():
    """Attack pass 3: the message said "must be in [1, ...]" while echo with 0 is documented."""
    with pytest.raises(InvalidRequestError, match="0 scores the prompt only with echo: true"):
        sampling_params_from_openai(completion(max_tokens=0))
    assert sampling_params_from_openai(completion(max_tokens=0, echo=True)).max_tokens == 1


def test_defaults_are_accepted_and_best_of_n_may_stream():
    assert sampling_params_from_openai(completion(best_of=1, logit_bias={}, presence_penalty=0, repetition_penalty=1,
                                                  stream=True, suffix="")) == SamplingParams(max_tokens=16, best_of=1)


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


def test_unimplemented_fields_are_refused_and_the_listed_ones_ignored():
    from pagedserve.services.gateway.openai_protocol import IGNORED_FIELDS

    history = [{"role": "user", "content": "Hi"},
               {"role": "assistant", "content": "Hello", "refusal": None, "annotations": [], "audio": None}]
    ignored = {"user": "u", "store": True, "metadata": {"k": "v"}, "service_tier": "auto"}
    assert set(ignored) == set(IGNORED_FIELDS)
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": history, **ignored})
    plain = ChatCompletionRequest.model_validate({"model": "m", "messages": history})
    assert sampling_params_from_openai(body) == sampling_params_from_openai(plain)
    assert not any(name in body.model_dump() for name in IGNORED_FIELDS)
    for name, value in (("user", "u" * 257), ("metadata", {f"k{i}": "v" for i in range(17)}),
                        ("metadata", {"k": "v" * 513}), ("store", "yes")):  # bounded though ignored (attack)
        with pytest.raises(pydantic.ValidationError, match=name):
            ChatCompletionRequest.model_validate({"model": "m", "messages": history, name: value})
    for extra in ({"use_beam_search": True}, {"stream_options": {"include_obfuscation": True}},
                  {"response_format": {"type": "json_object", "unknown": 1}}):
        with pytest.raises(pydantic.ValidationError, match="Extra inputs are not permitted"):
            ChatCompletionRequest.model_validate({"model": "m", "messages": history, **extra})
