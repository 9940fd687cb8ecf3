"""Size bounds of a GenerateRequest: every list and string is refused beyond its bound, naming the
field, before any costly work (tokenizing, building stop-string state)."""

from __future__ import annotations

import time

import pytest

from pagedserve.engine.sampling_params import InvalidRequestError
from pagedserve.text.request_limits import RequestLimits
from pagedserve.text.tokenizer import ChatTurn, PromptTokenizer
from pagedserve.services.common.pb import generate_pb2 as gen
from pagedserve.services.gateway.request_parser import parse_generate_request

LIMITS = RequestLimits()


def prompt(text: str = "Hi", **fields) -> gen.GenerateRequest:
    sampling = fields.pop("sampling", {})
    return gen.GenerateRequest(prompt=text, sampling_params=gen.SamplingParams(max_tokens=4, **sampling), **fields)


def chat(*turns: tuple[str, str]) -> gen.GenerateRequest:
    request = gen.GenerateRequest(sampling_params=gen.SamplingParams(max_tokens=4))
    for role, content in turns:
        request.chat.messages.add(role=role, content=content)
    return request


def refusal(request: gen.GenerateRequest, tokenizer: PromptTokenizer) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as err:
        parse_generate_request(request, tokenizer)
    assert str(err.value).startswith(err.value.field_name + ": ")
    return err.value


def test_default_limits() -> None:
    assert (LIMITS.max_stop_strings, LIMITS.max_stop_string_chars, LIMITS.max_stop_token_ids) == (64, 1024, 1024)
    assert (LIMITS.max_request_id_chars, LIMITS.max_cache_salt_chars, LIMITS.max_token_ids) == (256, 256, 1 << 20)
    assert LIMITS.max_prompt_bytes(8192) == 262144
    with pytest.raises(ValueError):
        RequestLimits(max_stop_strings=0)


def test_values_at_the_limits_are_accepted(prompt_tokenizer: PromptTokenizer) -> None:
    parsed = parse_generate_request(
        prompt(request_id="r" * 256, cache_salt="s" * 256,
               sampling={"stop": ["x" * 1024] * 63 + ["y"], "stop_token_ids": [5] * 1024, "n": 64}),
        prompt_tokenizer,
    ).parsed
    assert parsed.params.n == 64 and len(parsed.params.stop) == 64 and parsed.cache_salt == "s" * 256


TOO_BIG = [
    ("request_id", {"request_id": "r" * 257}, "257"),
    ("cache_salt", {"cache_salt": "s" * 257}, "257"),
    ("sampling_params.stop", {"sampling": {"stop": ["a"] * 65}}, "65"),
    ("sampling_params.stop[1]", {"sampling": {"stop": ["a", "b" * 1025]}}, "1025"),
    ("sampling_params.stop_token_ids", {"sampling": {"stop_token_ids": [5] * 1025}}, "1025"),
    ("sampling_params.n", {"sampling": {"n": 65}}, "65"),
    ("sampling_params.bad_words", {"sampling": {"bad_words": ["a"] * 65}}, "65"),
    ("sampling_params.bad_words[0]", {"sampling": {"bad_words": ["b" * 1025]}}, "1025"),
    ("sampling_params.allowed_token_ids", {"sampling": {"allowed_token_ids": [5] * ((1 << 20) + 1)}}, str((1 << 20) + 1)),
]


@pytest.mark.parametrize(("field", "fields", "number"), TOO_BIG, ids=[t[0] for t in TOO_BIG])
def test_oversized_field_is_refused_naming_it(prompt_tokenizer: PromptTokenizer, field, fields, number) -> None:
    err = refusal(prompt(**fields), prompt_tokenizer)
    assert err.field_name == field and number in err.reason


def test_huge_prompt_is_refused_by_bytes_before_tokenizing(prompt_tokenizer: PromptTokenizer) -> None:
    # Issue #9: a 3.9 MB prompt was tokenized whole (6 s) before its length was checked.
    started = time.perf_counter()
    err = refusal(prompt("é" * 1_950_000), prompt_tokenizer)
    assert time.perf_counter() - started < 0.5
    assert err.field_name == "prompt" and "262144" in err.reason and "bytes" in err.reason


def test_prompt_bytes_count_utf8_not_characters(prompt_tokenizer: PromptTokenizer) -> None:
    budget = prompt_tokenizer.max_prompt_bytes
    err = refusal(prompt("é" * (budget // 2 + 1)), prompt_tokenizer)  # fewer characters than bytes allowed
    assert err.field_name == "prompt" and str(budget + 2) in err.reason


def test_chat_sizes_are_checked_before_rendering(prompt_tokenizer: PromptTokenizer) -> None:
    budget = prompt_tokenizer.max_prompt_bytes
    assert refusal(chat(*[("user", "hi")] * 1025), prompt_tokenizer).field_name == "chat.messages"
    err = refusal(chat(("user", "hi"), ("user", "x" * (budget + 1))), prompt_tokenizer)
    assert err.field_name == "chat.messages[1].content"
    err = refusal(chat(("user", "x" * (budget // 2)), ("user", "y" * (budget // 2 + 1))), prompt_tokenizer)
    assert err.field_name == "chat.messages" and str(budget) in err.reason
    err = refusal(chat(("user", "hi"), ("u" * 100_000, "hi")), prompt_tokenizer)
    assert err.field_name == "chat.messages[1].role" and len(str(err)) < 200


def test_token_ids_are_counted_before_they_are_checked(prompt_tokenizer: PromptTokenizer) -> None:
    err = refusal(gen.GenerateRequest(prompt_token_ids=gen.TokenIds(ids=[-1] * 9000)), prompt_tokenizer)
    assert err.field_name == "prompt_token_ids.ids" and "9000" in err.reason


def test_offline_api_checks_the_same_bounds(prompt_tokenizer: PromptTokenizer) -> None:
    with pytest.raises(InvalidRequestError) as err:
        prompt_tokenizer.encode_chat([ChatTurn("user", "x" * (prompt_tokenizer.max_prompt_bytes + 1))])
    assert err.value.field_name == "chat.messages[0].content"
