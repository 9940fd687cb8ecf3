"""The gateway's OpenAI-compatible HTTP API end to end: the real `openai` client and raw SSE bytes
(httpx) against the session stack's real processes."""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest

from pagedserve.services.common.pb import generate_pb2 as gen
from tests.e2e.test_stack import QUESTIONS, assert_all_blocks_free, chat_request, stream

pytestmark = [pytest.mark.e2e, pytest.mark.model]

PROMPTS = ["The capital of France is", "One, two, three,"]
API_KEY = "http-api-key-0123456789"


@pytest.fixture(scope="module")
def model_name(default_model) -> str:
    return default_model.name


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.http + "/v1", api_key="unused", max_retries=0, timeout=300)


def grpc_text(stack, request: gen.GenerateRequest) -> str:
    return "".join(r.text for r in stream(stack.gateway, request))


def sse_events(response: httpx.Response) -> list[bytes]:
    """The raw events of an SSE body, each checked to be ``data: ...`` followed by a blank line."""
    raw = response.read()
    assert raw.endswith(b"\n\n")
    events = raw[:-2].split(b"\n\n")
    assert all(e.startswith(b"data: ") and b"\n" not in e for e in events), raw[:500]
    return [e[len(b"data: "):] for e in events]


def test_models_health_tokenize_detokenize(stack, model_name, default_model):
    from pagedserve.text.tokenizer import ChatTurn, PromptTokenizer

    tokenizer = PromptTokenizer.from_folder(default_model)
    with httpx.Client(base_url=stack.http, timeout=60) as http:
        models = http.get("/v1/models").json()
        assert models["object"] == "list" and [m["id"] for m in models["data"]] == [model_name]
        assert models["data"][0]["max_model_len"] == tokenizer.info.max_model_len
        assert http.get("/health").status_code == 200
        tokens = http.post("/tokenize", json={"model": model_name, "prompt": PROMPTS[0]}).json()
        assert tokens["tokens"] == tokenizer.encode_prompt(PROMPTS[0]) and tokens["count"] == len(tokens["tokens"])
        chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
        assert chat["tokens"] == tokenizer.encode_chat([ChatTurn("user", "Hi")])
        text = http.post("/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"]
        assert text == PROMPTS[0]
        assert http.post("/detokenize", json={"tokens": [10**9]}).json()["error"]["param"] == "tokens[0]"
        context = tokenizer.info.max_model_len  # a whole context detokenizes; more is refused, without the prompt's
        assert http.post("/detokenize", json={"tokens": [100] * context}).status_code == 200  # advice (attack)
        assert http.post("/detokenize", json={"tokens": []}).json()["prompt"] == ""  # no ids: no text
        over = http.post("/detokenize", json={"tokens": [100] * (context + 1)}).json()["error"]
        assert over["param"] == "tokens" and "generated" not in over["message"], over


def test_completion_greedy_equals_grpc_and_streams_the_same_text(stack, client, model_name):
    expected = grpc_text(stack, gen.GenerateRequest(prompt=PROMPTS[0],
                                                    sampling_params=gen.SamplingParams(max_tokens=16, temperature=0.0)))
    whole = client.completions.create(model=model_name, prompt=PROMPTS[0], max_tokens=16, temperature=0)
    assert whole.object == "text_completion" and whole.id and whole.created and whole.model == model_name
    assert whole.choices[0].text == expected and whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 16 and whole.usage.total_tokens == whole.usage.prompt_tokens + 16
    chunks = list(client.completions.create(model=model_name, prompt=PROMPTS[0], max_tokens=16, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected


def test_chat_greedy_equals_grpc_streamed_or_not(stack, client, model_name):
    question = QUESTIONS[0]
    expected = grpc_text(stack, chat_request(question))
    messages = [{"role": "user", "content": question}]
    whole = client.chat.completions.create(model=model_name, messages=messages, max_tokens=24, temperature=0)
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == expected and "Paris" in expected
    chunks = list(client.chat.completions.create(model=model_name, messages=messages, max_completion_tokens=24,
                                                 temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_several_prompts_and_n_2_are_numbered_prompt_major(stack, client, model_name):
    expected = [grpc_text(stack, gen.GenerateRequest(prompt=p, sampling_params=gen.SamplingParams(
        max_tokens=8, temperature=0.0))) for p in PROMPTS]
    whole = client.completions.create(model=model_name, prompt=PROMPTS, max_tokens=8, temperature=0, n=2)
    assert [c.index for c in whole.choices] == [0, 1, 2, 3]
    assert [c.text for c in whole.choices] == [expected[0], expected[0], expected[1], expected[1]]
    assert whole.usage.completion_tokens == 4 * 8
    sampled = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "Hi"}],
                                             max_tokens=8, temperature=1.0, seed=7, n=2)
    assert [c.index for c in sampled.choices] == [0, 1]


def test_completion_sse_wire_format(stack, model_name):
    body = {"model": model_name, "prompt": PROMPTS, "max_tokens": 6, "temperature": 0, "n": 2, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.Client(base_url=stack.http, timeout=120) as http, http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    usage = chunks.pop()
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 4 * 6
    assert all(c["object"] == "text_completion" and len(c["choices"]) == 1 and c["usage"] is None for c in chunks)
    by_index: dict[int, list] = {}
    for c in chunks:
        by_index.setdefault(c["choices"][0]["index"], []).append(c["choices"][0])
    assert sorted(by_index) == [0, 1, 2, 3]
    for choices in by_index.values():
        assert [c["finish_reason"] for c in choices] == [None] * (len(choices) - 1) + ["length"]
        # the finish_reason comes alone (as OpenAI sends it), and no chunk before it is empty
        assert choices[-1]["text"] == "" and all(c["text"] for c in choices[:-1])


def test_chat_sse_wire_format(stack, model_name):
    # a stop string whose beginning keeps coming holds text back (the look-ahead); max_tokens ends it mid-text
    body = {"model": model_name, "messages": [{"role": "user", "content": QUESTIONS[2]}], "max_tokens": 12,
            "temperature": 0, "stream": True, "stop": [" the zzz", " a zzz", ". zzz", ", zzz"]}
    with httpx.Client(base_url=stack.http, timeout=120) as http, http.stream("POST", "/v1/chat/completions", json=body) as r:
        events = sse_events(r)
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" and "usage" in c for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:])
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    # the finish_reason comes alone with an empty delta (as OpenAI sends it); no empty chunk before it
    assert chunks[-1]["choices"][0]["delta"] == {}
    assert all(c["choices"][0]["delta"].get("content") for c in chunks[1:-1])


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "Hi", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "Hi", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": "Hi", "stop": ["x"] * 65}, "stop"),
    ("/v1/completions", {"prompt": {"text": "Hi"}}, "prompt"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 10**6}, "max_tokens"),
    ("/v1/completions", {"prompt": [1, -5]}, "prompt[1]"),
    ("/v1/completions", {"prompt": "Hi", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "Hi", "suffix": "x"}, "suffix"),
    ("/v1/completions", {"prompt": "Hi", "logit_bias": {"abc": 5}}, "logit_bias"),
    ("/v1/completions", {"prompt": "Hi", "logit_bias": {"5": 5, "05": -5}}, "logit_bias"),
    ("/v1/completions", {"prompt": "Hi", "repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"prompt": "Hi", "best_of": 2, "stream": True}, "best_of"),
    # values the services carry as uint64 / int32 / float32 (these were a 500, or garbage text)
    ("/v1/completions", {"prompt": "Hi", "seed": -1}, "seed"),
    ("/v1/completions", {"prompt": "Hi", "seed": 2**64}, "seed"),
    ("/v1/completions", {"prompt": "Hi", "top_k": 2**31}, "top_k"),
    ("/v1/completions", {"prompt": "Hi", "top_p": 1e-50}, "top_p"),
    ("/v1/completions", {"prompt": "Hi", "repetition_penalty": 1e-50}, "repetition_penalty"),
    ("/v1/completions", {"prompt": "Hi", "temperature": 1e39}, "temperature"),
    ("/v1/completions", {"prompt": "Hi", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "prompt_logprobs": 1},
     "prompt_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "logprobs": True, "top_logprobs": 21},
     "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "Hi"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "n": 1000}, "n"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "continue_final_message": True},
     "continue_final_message"),
    # fields pagedserve does not implement are refused, not dropped (issue #22 item 6)
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "functions": [{"name": "f"}]},
     "functions"),
    ("/v1/completions", {"prompt": "Hi", "use_beam_search": True}, "use_beam_search"),
    # a lone surrogate (sent as the JSON escape \ud800) inside a schema was a 500
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "description": "\ud800"}}}},
     "response_format.json_schema.schema"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "tools": [{"type": "function",
        "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"enum": ["\udfff"]}}}}}]},
     "tools[0].function.parameters"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi", "audio": {"id": "a"}}]},
     "messages[0].audio"),
    # and in a prompt, a content or a tool message's call id
    ("/v1/completions", {"prompt": "Hi \ud800"}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\udfff"}]}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "\ud800", "content": "x"}]}, "messages[2].tool_call_id"),
])
def test_invalid_input_is_a_400_naming_the_parameter(stack, model_name, path, body, param):
    content = json.dumps({"model": model_name, **body})  # ASCII: a lone surrogate travels as its escape
    response = httpx.post(stack.http + path, content=content, headers={"content-type": "application/json"}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["code"] == 400
    assert error["message"]


def stack_model_name(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_unknown_model_is_404_and_bad_json_is_400(stack, client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="no-such-model", prompt="Hi", max_tokens=2)
    assert info.value.body["param"] == "model"
    response = httpx.post(stack.http + "/v1/completions", content=b"{not json", timeout=60,
                          headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["param"] is None
    assert "not valid JSON" in response.json()["error"]["message"]
    for body, reason in ((b'{"prompt": "\xff"}', "UnicodeDecodeError"), (b'{"n": ' + b"9" * 5000 + b"}", "ValueError")):
        response = httpx.post(stack.http + "/v1/completions", content=body, timeout=60,
                              headers={"content-type": "application/json"})  # the reason, not only "an error"
        assert response.status_code == 400 and reason in response.json()["error"]["message"], response.text
    for content_type in ("text/plain", "application/x-www-form-urlencoded"):  # review 68; curl -d's default
        response = httpx.post(stack.http + "/v1/completions", content=b'{"prompt": "Hi"}', timeout=60,
                              headers={"content-type": content_type})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["message"] == ("send the body as a JSON object with the header Content-Type: "
                                                       f"application/json (got Content-Type: {content_type})")
    assert httpx.get(stack.http + "/v1/nothing-here", timeout=60).json()["error"]["code"] == 404
    wrong_method = httpx.get(stack.http + "/v1/completions", timeout=60).json()["error"]
    assert (wrong_method["code"], wrong_method["type"]) == (405, "invalid_request_error")
    assert httpx.head(stack.http + "/health", timeout=60).status_code == 200
    assert client.models.retrieve(stack_model_name(client)).id == stack_model_name(client)
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_continue_final_message_continues_the_assistant_text(stack, client, model_name):
    messages = [{"role": "user", "content": QUESTIONS[0]}, {"role": "assistant", "content": "The capital of France"}]
    reply = client.chat.completions.create(model=model_name, messages=messages, max_tokens=8, temperature=0,
                                           extra_body={"add_generation_prompt": False, "continue_final_message": True})
    assert "Paris" in reply.choices[0].message.content


def test_a_client_that_disconnects_mid_stream_frees_its_blocks(stack, client, model_name):
    body = {"model": model_name, "prompt": PROMPTS[1], "max_tokens": 400, "ignore_eos": True, "stream": True}
    other: dict = {}

    def run_other() -> None:
        other["text"] = client.completions.create(model=model_name, prompt=PROMPTS[0], max_tokens=40,
                                                  temperature=0).choices[0].text

    with httpx.Client(base_url=stack.http, timeout=120) as http:
        with http.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            thread = threading.Thread(target=run_other)
            thread.start()
            next(lines)
        # the stream is closed mid-way here; a non-streaming request is dropped by its timeout
        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/completions", json={**body, "stream": False}, timeout=2)
    thread.join(300)
    # a client leaving is no error of the server's: the gateway logs no traceback for it (a trace
    # span exported to the log may still name ClientDisconnected as its error type)
    assert "Exception in ASGI application" not in stack.processes["gateway"].log_text()
    expected = grpc_text(stack, gen.GenerateRequest(prompt=PROMPTS[0],
                                                    sampling_params=gen.SamplingParams(max_tokens=40, temperature=0.0)))
    assert other["text"] == expected
    assert_all_blocks_free(stack)
