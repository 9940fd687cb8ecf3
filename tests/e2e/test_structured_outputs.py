"""Structured outputs through the services: the real `openai` client's `.parse()` with a pydantic model
(streamed and not), the same schema over gRPC, and bad specs refused with 400 / INVALID_ARGUMENT
naming the field, on the session stack's real processes."""

from __future__ import annotations

import concurrent.futures
import json
from typing import Literal

import grpc
import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.e2e.test_stack import chat_request, stream
from tests.engine.test_structured_outputs import PERSON

pytestmark = [pytest.mark.e2e, pytest.mark.model]


class Address(BaseModel):
    city: str = Field(max_length=16)
    zip_code: int = Field(ge=10000, le=99999)


class Person(BaseModel):
    name: str = Field(max_length=16)
    age: int = Field(ge=0, le=120)
    color: Literal["red", "green", "blue"]
    tags: list[str] = Field(max_length=2)
    address: Address


QUESTION = [{"role": "user", "content": "Describe a person as JSON."}]


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.http + "/v1", api_key="unused", max_retries=0, timeout=300)


def strict_schema() -> dict:
    """Person's schema as `.parse()` sends it (the openai client's strict form)."""
    from openai.lib._pydantic import to_strict_json_schema

    return to_strict_json_schema(Person)


def test_openai_parse_returns_the_pydantic_object(client, default_model):
    completion = client.chat.completions.parse(model=default_model.name, messages=QUESTION, response_format=Person,
                                               temperature=0, max_tokens=120)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(choice.message.parsed, Person)
    jsonschema.validate(json.loads(choice.message.content), strict_schema())


def test_streamed_json_schema_output_validates_and_equals_the_unstreamed(client, default_model):
    response_format = {"type": "json_schema", "json_schema": {"name": "Person", "schema": strict_schema(), "strict": True}}
    kwargs = dict(model=default_model.name, messages=QUESTION, response_format=response_format, temperature=0,
                  max_tokens=120)
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    Person.model_validate_json(text)
    assert text == client.chat.completions.create(**kwargs).choices[0].message.content


def test_n3_with_a_seed_gives_three_valid_samples_again(client, default_model):
    """Every string bounded (``PERSON``), so that no sample at temperature 1 runs to ``length``."""
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    kwargs = dict(model=default_model.name, messages=QUESTION, response_format=response_format, temperature=1.0,
                  seed=5, n=3, max_tokens=160)
    choices = client.chat.completions.create(**kwargs).choices
    texts = [c.message.content for c in choices]
    assert [c.finish_reason for c in choices] == ["stop"] * 3, texts
    for text in texts:
        jsonschema.validate(json.loads(text), PERSON)
    assert len(set(texts)) == 3
    assert [c.message.content for c in client.chat.completions.create(**kwargs).choices] == texts


def test_json_object_gives_an_object_streamed_and_not(client, default_model):
    kwargs = dict(model=default_model.name, messages=[{"role": "user", "content": "Give the capital of France as JSON with the key capital."}],
                  response_format={"type": "json_object"}, temperature=0, max_tokens=120)
    whole = client.chat.completions.create(**kwargs).choices[0]
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kwargs)
                       if c.choices)
    assert whole.finish_reason == "stop" and isinstance(json.loads(whole.message.content), dict), whole.message.content
    assert streamed == whole.message.content


def test_top_logprobs_list_only_tokens_the_grammar_allows(client, default_model):
    """A choice of two answers with five alternatives asked for at each position: where fewer than five
    tokens are possible, fewer are listed, never a token the grammar rules out at -9999 (before: those
    were listed too, and which of them changed with the batch)."""
    kwargs = dict(model=default_model.name, messages=[{"role": "user", "content": "Is the sky blue?"}], temperature=0,
                  max_tokens=8, logprobs=True, top_logprobs=5,
                  extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.message.content in ("yes", "no")
    tops = [entry.top_logprobs for entry in choice.logprobs.content]
    assert tops and all(t.logprob > -9999 for top in tops for t in top), tops
    assert len(tops[-1]) < 5  # the answer's last token: few tokens can follow it


def test_grpc_json_schema_gives_the_same_output(stack, client, default_model):
    schema = json.dumps(strict_schema())
    request = chat_request(QUESTION[0]["content"], max_tokens=120)
    request.sampling_params.structured_output.json = schema
    responses = stream(stack.gateway, request)
    text = "".join(r.text for r in responses)
    Person.model_validate_json(text)
    http = client.chat.completions.create(model=default_model.name, messages=QUESTION, temperature=0, max_tokens=120,
                                          extra_body={"structured_outputs": {"json": json.loads(schema)}})
    assert http.choices[0].message.content == text


@pytest.mark.parametrize("member, value", [
    ("regex", "a(b"), ("grammar", "root ::= ("), ("json", '{"type": "nonsense"}'), ("json", "x" * (1 << 20)),
    ("json_object", False), ("choice", [f"c{i}" for i in range(2048)]), ("json", "true")],  # attacks of 2026-12-07:
    ids=["bad-regex", "bad-grammar", "invalid-schema", "1MB-schema", "json-object-false", "2048-choices",
         "boolean-schema"])  # json_object false was taken as true, a boolean schema was UNKNOWN
def test_grpc_bad_spec_is_invalid_argument_naming_the_field(stack, member, value):
    request = chat_request("Hi", max_tokens=4)
    if member == "choice":
        request.sampling_params.structured_output.choice.choices.extend(value)
    else:
        setattr(request.sampling_params.structured_output, member, value)
    with pytest.raises(grpc.RpcError) as info:
        stream(stack.gateway, request)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(f"sampling_params.structured_output.{member}:"), info.value.details()


@pytest.mark.parametrize("body, param", [
    ({"guided_regex": "a(b"}, "guided_regex"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "big", "schema": {"type": "object", "description": "x" * (1 << 20)}}}},
     "response_format.json_schema.schema"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
    ({"guided_choice": [f"c{i}" for i in range(1025)]}, "guided_choice"),  # llguidance failed at 2,000
], ids=["bad-regex", "invalid-schema", "1MB-schema", "two-forms", "1025-choices"])
def test_http_bad_spec_is_400_naming_the_field(stack, default_model, body, param):
    with httpx.Client(base_url=stack.http, timeout=60) as http:
        response = http.post("/v1/chat/completions", json={"model": default_model.name, "messages": QUESTION,
                                                           "max_tokens": 4, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.text


WIDE_SCHEMA = {"type": "object", "properties": {f"key_{i}": {"type": "integer"} for i in range(600)},
               "additionalProperties": False}


LOOP = {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
LOOPING_TOOL = {"type": "function", "function": {"name": "f", "parameters": LOOP}}


@pytest.mark.parametrize("structured, reason, param", [
    ({"structured_outputs": {"grammar": "start: <|no_such_token|>"}}, "unknown special token",
     "structured_outputs.grammar"),
    ({"structured_outputs": {"json": WIDE_SCHEMA}}, "max is 2000", "structured_outputs.json"),
    ({"guided_json": LOOP}, "grammar failed", "guided_json"),
    ({"tools": [LOOPING_TOOL], "tool_choice": "required"}, "grammar failed", "tools"),
], ids=["fails-to-build", "past-parser-limit", "ref-loop", "tool-ref-loop"])
def test_a_grammar_the_worker_cannot_run_is_400_and_spares_the_other_requests(stack, default_model, structured,
                                                                               reason, param):
    """Specs that pass the gateway's check (it has no vocabulary, and does not decode) but fail on
    the worker: the request ends with 400 saying why and naming the client's field, not with free
    text or a silent stop, and a stream beside it is unchanged."""
    body = {"model": default_model.name, "messages": QUESTION, "max_tokens": 40, "temperature": 0}
    with httpx.Client(base_url=stack.http, timeout=120) as http:
        alone = http.post("/v1/chat/completions", json={**body, "max_tokens": 16}).json()
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            beside = pool.submit(http.post, "/v1/chat/completions", json={**body, "max_tokens": 16})
            refused = http.post("/v1/chat/completions", json={**body, **structured})
            beside = beside.result().json()
    assert refused.status_code == 400, refused.text
    assert reason in refused.json()["error"]["message"], refused.text
    assert refused.json()["error"]["param"] == param, refused.text
    assert refused.json()["error"]["message"].startswith(f"{param}: "), refused.text
    assert beside["choices"][0]["message"]["content"] == alone["choices"][0]["message"]["content"]


def test_grpc_a_grammar_that_fails_to_build_is_invalid_argument(stack):
    request = chat_request("Hi", max_tokens=4)
    request.sampling_params.structured_output.grammar = "start: <|no_such_token|>"
    with pytest.raises(grpc.RpcError) as info:
        stream(stack.gateway, request)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("sampling_params.structured_output.grammar: "), info.value.details()
    assert "unknown special token" in info.value.details(), info.value.details()
