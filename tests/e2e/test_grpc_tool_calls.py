"""Tool calls over gRPC through the services: `required` and a named function give calls whose
arguments validate against the function's schema, and the same calls, content and finish reason as
the HTTP API for the same greedy request; `auto` (hermes parser) equals HTTP's; each call comes
whole in the message where its text ends and never in the text; a conversation with a tool result
continues; bad tool input is INVALID_ARGUMENT naming the field."""

from __future__ import annotations

import json

import grpc
import httpx
import jsonschema
import pytest

from pagedserve.services.common.pb import generate_pb2 as gen
from tests.e2e.test_stack import stream
from tests.e2e.test_tool_calls import QUESTION, SCHEMAS, TOOLS

pytestmark = [pytest.mark.e2e, pytest.mark.model]

MAX_TOKENS = 80
FORCED_CALL = ('Checking.\n<tool_call>\n{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}\n'
               '</tool_call>')
"""An answer with content and a call, forced (a structured output choice) so that `auto` parses a call whatever the model."""
TOOL_RESULT = [{"role": "assistant", "content": "", "tool_calls": [
    {"id": "call_abc123", "type": "function",
     "function": {"name": "get_weather", "arguments": '{"city":"Paris","unit":"celsius","days":3}'}}]},
    {"role": "tool", "tool_call_id": "call_abc123", "content": '{"forecast":"sunny, 24 C"}'}]


def grpc_request(messages: list[dict], choice: str | None = None, parallel: bool | None = None,
                 max_tokens: int = MAX_TOKENS) -> gen.GenerateRequest:
    """The request the HTTP body of `messages`, TOOLS and `choice` is, in the gRPC API's shapes
    (`choice`: a mode's name in lower case, or the name of the function to call)."""
    request = gen.GenerateRequest(sampling_params=gen.SamplingParams(max_tokens=max_tokens, temperature=0.0))
    chat = request.chat
    for m in messages:
        calls = [gen.ToolCall(id=c["id"], name=c["function"]["name"], arguments=c["function"]["arguments"])
                 for c in m.get("tool_calls", ())]
        chat.messages.add(role=m["role"], content=m["content"], tool_calls=calls, tool_call_id=m.get("tool_call_id", ""))
    for tool in TOOLS:
        f = tool["function"]
        chat.tools.add(name=f["name"], description=f["description"], parameters=json.dumps(f["parameters"]))
    if choice in ("none", "auto", "required"):
        chat.tool_choice.mode = gen.ToolChoice.Mode.Value(f"MODE_{choice.upper()}")
    elif choice is not None:
        chat.tool_choice.function = choice
    if parallel is not None:
        chat.parallel_tool_calls = parallel
    return request


def grpc_answer(stack, request: gen.GenerateRequest) -> tuple[str | None, list[tuple[str, str]], str]:
    """(content or None, [(name, arguments)], finish reason as HTTP names it) of sample 0, checking
    that each call came whole in one message and no call's text came as text (but a call cut short, by
    max_tokens or a stop string, which is no call: its text comes as text)."""
    responses = stream(stack.gateway, request)
    text = "".join(r.text for r in responses)
    calls = [call for r in responses for call in r.tool_calls]
    assert all(call.id.startswith("call_") for call in calls) and len({c.id for c in calls}) == len(calls)
    assert all(not r.finish_reason for r in responses[:-1]) and responses[-1].finish_reason
    reason = gen.FinishReason.Name(responses[-1].finish_reason).removeprefix("FINISH_REASON_").lower()
    if reason != "length" and not responses[-1].HasField("stop_reason"):
        assert "<tool_call>" not in text and "</tool_call>" not in text, text
    return text or None, [(c.name, c.arguments) for c in calls], reason


def http_answer(stack, model, messages: list[dict], **body) -> tuple[str | None, list[tuple[str, str]], str]:
    """The same triple from the HTTP API."""
    response = httpx.post(stack.http + "/v1/chat/completions", timeout=300, json={
        "model": model.name, "messages": messages, "tools": TOOLS, "temperature": 0, "max_tokens": MAX_TOKENS, **body})
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in choice["message"].get("tool_calls") or ()]
    return choice["message"]["content"], calls, choice["finish_reason"]


def assert_valid_calls(calls: list[tuple[str, str]]) -> None:
    assert calls
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_required_gives_a_valid_call_equal_to_http(small_stack, small_model):
    answer = grpc_answer(small_stack, grpc_request(QUESTION, "required", parallel=False))
    content, calls, reason = answer
    assert reason == "tool_calls" and content is None and len(calls) == 1, answer
    assert_valid_calls(calls)
    assert answer == http_answer(small_stack, small_model, QUESTION, tool_choice="required", parallel_tool_calls=False)


def test_required_parallel_gives_valid_calls_equal_to_http(stack, default_model):
    """The default model repeats calls until max_tokens cuts one: every call given validates, the cut
    one is text (no call), and the answer is HTTP's."""
    answer = grpc_answer(stack, grpc_request(QUESTION, "required"))
    assert len(answer[1]) > 1 and answer[2] == "length", answer
    assert_valid_calls(answer[1])
    assert answer[0].startswith("<tool_call>")
    assert answer == http_answer(stack, default_model, QUESTION, tool_choice="required")


STOP_AT_FIRST_KEY = ["city", "timezone"]


def test_a_call_cut_by_a_stop_string_is_no_call_and_the_answer_stopped(small_stack, small_model):
    """A stop string inside a required call cuts its JSON (the stop strings are the first keys of the two
    functions' arguments, which the grammar writes first, whichever function the model calls): the answer
    gives no call, its text as written is the content, and the finish reason is stop (before: a call with
    arguments '{"', and tool_calls), over gRPC as over HTTP, and HTTP's stream says stop too."""
    request = grpc_request(QUESTION, "required", parallel=False)
    request.sampling_params.stop.extend(STOP_AT_FIRST_KEY)
    answer = grpc_answer(small_stack, request)
    content, calls, reason = answer
    assert calls == [] and reason == "stop" and content.startswith("<tool_call>"), answer
    assert content.endswith('"arguments":{"'), answer
    body = dict(tool_choice="required", parallel_tool_calls=False, stop=STOP_AT_FIRST_KEY)
    assert answer == http_answer(small_stack, small_model, QUESTION, **body)
    chunks = httpx.post(small_stack.http + "/v1/chat/completions", timeout=300, json={
        "model": small_model.name, "messages": QUESTION, "tools": TOOLS, "temperature": 0, "max_tokens": MAX_TOKENS,
        "stream": True, **body}).text.split("\n\n")
    finals = [json.loads(c[6:])["choices"][0] for c in chunks if c.startswith("data: {") and '"finish_reason":"' in c]
    assert [f["finish_reason"] for f in finals] == ["stop"] and finals[0]["stop_reason"] in STOP_AT_FIRST_KEY


def test_named_function_is_the_one_called_as_over_http(small_stack, small_model):
    answer = grpc_answer(small_stack, grpc_request(QUESTION, "get_time"))
    assert answer[2] == "tool_calls" and [name for name, _ in answer[1]] == ["get_time"]
    assert_valid_calls(answer[1])
    named = {"type": "function", "function": {"name": "get_time"}}
    assert answer == http_answer(small_stack, small_model, QUESTION, tool_choice=named)


@pytest.mark.parametrize("forced", [False, True], ids=["free", "forced-call"])
def test_auto_parses_as_http_does(small_stack, small_model, forced):
    request = grpc_request(QUESTION, "auto")
    body: dict = {"tool_choice": "auto"}
    if forced:
        request.sampling_params.structured_output.choice.choices.append(FORCED_CALL)
        body["structured_outputs"] = {"choice": [FORCED_CALL]}
    answer = grpc_answer(small_stack, request)
    if forced:
        assert answer == ("Checking.", [("get_time", '{"timezone": "Europe/Paris"}')], "tool_calls")
    assert answer == http_answer(small_stack, small_model, QUESTION, **body)


def test_none_leaves_the_text_unparsed(small_stack):
    request = grpc_request(QUESTION, "none", max_tokens=len(FORCED_CALL))
    request.sampling_params.structured_output.choice.choices.append(FORCED_CALL)
    responses = stream(small_stack.gateway, request)
    assert not any(r.tool_calls for r in responses)
    assert "".join(r.text for r in responses) == FORCED_CALL
    assert responses[-1].finish_reason == gen.FinishReason.FINISH_REASON_STOP


def test_conversation_with_a_tool_result_continues(small_stack, small_model):
    messages = QUESTION + TOOL_RESULT
    content, calls, reason = answer = grpc_answer(small_stack, grpc_request(messages, max_tokens=24))
    assert (content or calls) and reason in ("stop", "length", "tool_calls"), answer
    assert answer == http_answer(small_stack, small_model, messages, max_tokens=24)


def test_a_whole_call_stopped_at_its_closing_tag_is_a_call_and_the_answer_stopped(small_stack, small_model):
    """``stop: ["</tool_call>"]`` ends the answer after a call's whole JSON: the call stands (as vLLM reads
    it), and the finish reason is stop, not tool_calls (a stop string is the client's cut, not the answer
    ending by itself; attack 58 saw tool_calls here and stop with include_stop_str_in_output)."""
    for include in (False, True):
        request = grpc_request(QUESTION, "required", parallel=False)
        request.sampling_params.stop.append("</tool_call>")
        request.sampling_params.include_stop_str_in_output = include
        answer = grpc_answer(small_stack, request)
        assert len(answer[1]) == 1 and answer[2] == "stop", answer
        body = dict(tool_choice="required", parallel_tool_calls=False, stop=["</tool_call>"],
                    include_stop_str_in_output=include)
        assert answer == http_answer(small_stack, small_model, QUESTION, **body)


def _no_tool_call_id(request: gen.GenerateRequest) -> None:
    request.chat.messages[2].tool_call_id = ""


def _with_structured_output(request: gen.GenerateRequest) -> None:
    request.sampling_params.structured_output.json_object = True


BAD = {
    "unknown-function": ("nope", lambda r: None, "chat.tool_choice.function"),
    "no-tools": ("required", lambda r: r.chat.ClearField("tools"), "chat.tool_choice"),
    "bad-schema": (None, lambda r: setattr(r.chat.tools[0], "parameters", '{"type": "nonsense"}'),
                   "chat.tools[0].parameters"),
    "not-json": (None, lambda r: setattr(r.chat.tools[1], "parameters", "{"), "chat.tools[1].parameters"),
    "1MB-schema": (None, lambda r: setattr(r.chat.tools[0], "parameters", json.dumps(
        {"type": "object", "description": "x" * (1 << 20)})), "chat.tools[0].parameters"),
    "bad-name": (None, lambda r: setattr(r.chat.tools[0], "name", "get weather"), "chat.tools[0].name"),
    "same-names": (None, lambda r: setattr(r.chat.tools[1], "name", "get_weather"), "chat.tools"),
    "too-many-tools": (None, lambda r: r.chat.tools.extend([r.chat.tools[0]] * 127), "chat.tools"),
    "tool-without-call-id": (None, _no_tool_call_id, "chat.messages[2].tool_call_id"),
    "call-id-on-user": (None, lambda r: setattr(r.chat.messages[0], "tool_call_id", "x"),
                        "chat.messages[0].tool_call_id"),
    "calls-on-user": (None, lambda r: r.chat.messages[0].tool_calls.add(id="x", name="f", arguments="{}"),
                      "chat.messages[0].tool_calls"),
    "unknown-mode": (None, lambda r: setattr(r.chat.tool_choice, "mode", 9), "chat.tool_choice.mode"),
    "with-structured-output": ("required", _with_structured_output, "chat.tool_choice"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_tool_input_is_invalid_argument_naming_the_field(small_stack, case):
    choice, change, field = BAD[case]
    request = grpc_request(QUESTION + TOOL_RESULT, choice, max_tokens=4)
    change(request)
    with pytest.raises(grpc.RpcError) as info:
        stream(small_stack.gateway, request)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert info.value.details().startswith(f"{field}:"), info.value.details()
