"""Tool calls through the services with the real `openai` client: `required` and a named function give
calls whose arguments validate against the function's schema (streamed and not, the same calls),
a conversation with a tool result continues, and bad tool requests are 400 naming the field."""

from __future__ import annotations

import json
import time

import httpx
import jsonschema
import openai
import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.model]

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 20},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "unit", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 32}},
        "required": ["timezone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast of a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Current time in a timezone",
                                           "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
QUESTION = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.http + "/v1", api_key="unused", max_retries=0, timeout=300)


def ask(client, model, **kwargs):
    return client.chat.completions.create(model=model.name, messages=QUESTION, tools=TOOLS, temperature=0,
                                          max_tokens=80, **kwargs)


def assert_valid_calls(calls) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_tool_choice_gives_calls_that_validate(client, default_model):
    choice = ask(client, default_model, tool_choice="required", parallel_tool_calls=False).choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    assert choice.message.content is None
    assert len(choice.message.tool_calls) == 1
    assert_valid_calls(choice.message.tool_calls)


def test_named_function_is_the_one_called(client, default_model):
    named = {"type": "function", "function": {"name": "get_time"}}
    choice = ask(client, default_model, tool_choice=named).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert [call.function.name for call in choice.message.tool_calls] == ["get_time"]
    assert_valid_calls(choice.message.tool_calls)


def test_streamed_calls_equal_the_unstreamed(client, default_model):
    kwargs = dict(tool_choice="required", parallel_tool_calls=False)
    whole = ask(client, default_model, **kwargs).choices[0]
    chunks = list(ask(client, default_model, stream=True, **kwargs))
    calls: dict[int, dict] = {}
    for chunk in chunks:
        delta = chunk.choices[0].delta
        assert not delta.content, "text of a call was streamed as content"
        for piece in delta.tool_calls or ():
            if piece.id is not None:  # a call's first piece: id, type and name once
                assert piece.index not in calls and piece.type == "function"
                calls[piece.index] = {"name": piece.function.name, "arguments": piece.function.arguments or ""}
            else:
                assert piece.function.name is None
                calls[piece.index]["arguments"] += piece.function.arguments
    finals = [c.choices[0] for c in chunks if c.choices[0].finish_reason is not None]
    assert len(finals) == 1 and finals[0].finish_reason == "tool_calls"
    assert finals[0].delta.content is None and finals[0].delta.tool_calls is None  # alone, empty delta
    assert [calls[i] for i in sorted(calls)] == [
        {"name": c.function.name, "arguments": c.function.arguments} for c in whole.message.tool_calls]


def test_conversation_with_a_tool_result_continues(client, default_model, stack):
    call = {"id": "call_abc123", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city":"Paris","unit":"celsius","days":3}'}}
    messages = QUESTION + [{"role": "assistant", "content": None, "tool_calls": [call]},
                           {"role": "tool", "tool_call_id": "call_abc123", "content": '{"forecast":"sunny, 24 C"}'}]
    choice = client.chat.completions.create(model=default_model.name, messages=messages, tools=TOOLS,
                                            temperature=0, max_tokens=24).choices[0]
    assert choice.finish_reason in ("stop", "length") and choice.message.content
    with httpx.Client(base_url=stack.http, timeout=60) as http:
        ids = http.post("/tokenize", json={"messages": messages}).json()["tokens"]
        prompt = http.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"' in prompt
    assert '<tool_response>\n{"forecast":"sunny, 24 C"}\n</tool_response>' in prompt


@pytest.mark.parametrize("body, param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]},
     "tools[0].function.parameters"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools[0].function.parameters"),  # arguments came back as a JSON string (attack of 2026-12-07)
], ids=["unknown-function", "no-tools", "bad-parameters", "with-response-format", "not-an-object"])
def test_bad_tool_request_is_400_naming_the_field(stack, default_model, body, param):
    response = httpx.post(stack.http + "/v1/chat/completions", timeout=60,
                          json={"model": default_model.name, "messages": QUESTION, "max_tokens": 4, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.text


def test_tool_calls_in_the_history_count_toward_the_chats_byte_bound(stack, default_model):
    """Attack (2026-12-07): calls counted by their arguments alone (``{}``: 2 bytes, ~24 tokens rendered) let 64
    messages x 1,024 calls (5.4 MB) past the 256 KiB bound: 1.57 million tokens, 13.5 s of gateway CPU before the
    400. Expected: 400 saying the chat's bytes are over the bound, at once."""
    calls = [{"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": "{}"}} for i in range(1024)]
    messages = [{"role": "user", "content": "x"}] + [{"role": "assistant", "tool_calls": calls}] * 64
    started = time.monotonic()
    response = httpx.post(stack.http + "/v1/chat/completions", timeout=60,
                          json={"model": default_model.name, "messages": messages, "max_tokens": 2})
    assert response.status_code == 400 and "UTF-8 bytes together" in response.json()["error"]["message"], response.text
    assert time.monotonic() - started < 15  # the old code spent 13.5 s, then gave a 400 by token count

