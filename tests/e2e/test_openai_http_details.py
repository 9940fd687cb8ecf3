"""OpenAI API details clients trip on (issue #22 item 7), through the session stack's real gateway:
``text_offset`` of an echoed prompt with a BOS, prompt scoring (``echo`` with ``max_tokens: 0``),
vLLM's ``stream_options.continuous_usage_stats``, the ``bytes`` of tokens that are pieces of a
UTF-8 character, and no ``tool_calls`` key in answers that call no tool."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.e2e.processes import start_gateway
from tests.e2e.test_openai_http import PROMPTS, client, model_name, sse_events  # noqa: F401 (module fixtures)

pytestmark = [pytest.mark.e2e, pytest.mark.model]
TOL = 1e-4
"""The same prompt positions scored in two requests (one may hit the prefix cache: another
summation order of the same float32 values)."""
BOS = "<|im_start|>"
"""The default model's BOS token (id 1), which its tokenizer does not add; the BOS gateway's does."""


@pytest.fixture(scope="module")
def bos_http(stack, default_model, tmp_path_factory):
    """The HTTP URL of a second gateway on the session stack whose tokenizer puts ``BOS`` before
    every text prompt, as Llama's does: the default model's folder (same name, same weights) with
    that post-processor in its tokenizer.json."""
    from tokenizers import Tokenizer, processors

    folder = tmp_path_factory.mktemp("bos-model") / default_model.name
    folder.mkdir()
    for path in default_model.iterdir():
        if path.name != "tokenizer.json":
            (folder / path.name).symlink_to(path)
    tokenizer = Tokenizer.from_file(str(default_model / "tokenizer.json"))
    tokenizer.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, 1)])
    tokenizer.save(str(folder / "tokenizer.json"))
    process, _, http = start_gateway("bos-gateway", stack, folder, tmp_path_factory.mktemp("bos-gateway"))
    yield http
    process.stop()


def completion(http: str, body: dict) -> dict:
    response = httpx.post(http + "/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def streamed_chunks(http: str, path: str, body: dict) -> list[dict]:
    with httpx.Client(base_url=http, timeout=120) as h, h.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        events = sse_events(r)
    assert events[-1] == b"[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_echo_text_offsets_index_the_prompt_as_sent_when_the_tokenizer_adds_a_bos(bos_http, model_name):  # noqa: F811
    prompt = PROMPTS[0]
    body = {"model": model_name, "prompt": prompt, "max_tokens": 4, "temperature": 0, "echo": True, "logprobs": 1}
    choice = completion(bos_http, body)["choices"][0]
    text, lp = choice["text"], choice["logprobs"]
    assert text.startswith(prompt) and lp["tokens"][0] == BOS and lp["token_logprobs"][0] is None
    # the BOS is not in the echoed text: it stands at 0 and takes no room; every other token is where it is
    assert lp["text_offset"][:2] == [0, 0]
    for token, offset in zip(lp["tokens"][1:], lp["text_offset"][1:]):
        assert text.startswith(token, offset), (token, offset, text)
    assert len(prompt) in lp["text_offset"]  # the completion's first token starts right after the prompt
    chunks = streamed_chunks(bos_http, "/v1/completions", body)
    assert "".join(c["choices"][0]["text"] for c in chunks) == text
    assert [o for c in chunks for o in c["choices"][0]["logprobs"]["text_offset"]] == lp["text_offset"]


def test_max_tokens_0_with_echo_scores_the_prompt(stack, model_name):  # noqa: F811
    prompt = PROMPTS[1]
    body = {"model": model_name, "prompt": prompt, "temperature": 0, "echo": True, "logprobs": 2}
    scored = completion(stack.http, {**body, "max_tokens": 0})
    choice, usage = scored["choices"][0], scored["usage"]
    assert choice["text"] == prompt and choice["finish_reason"] == "length"
    assert usage["completion_tokens"] == 0 and usage["total_tokens"] == usage["prompt_tokens"]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == usage["prompt_tokens"] and "".join(lp["tokens"]) == prompt
    # the prompt's logprobs are those the same prompt gets echoed before a completion
    generated = completion(stack.http, {**body, "max_tokens": 2})["choices"][0]["logprobs"]
    assert lp["token_logprobs"][0] is None and lp["tokens"] == generated["tokens"][:-2]
    assert all(abs(a - b) < TOL for a, b in zip(lp["token_logprobs"][1:], generated["token_logprobs"][1:-2]))
    chunks = streamed_chunks(stack.http, "/v1/completions", {**body, "max_tokens": 0})
    assert [c["choices"][0]["text"] for c in chunks] == [prompt, ""]
    assert chunks[0]["choices"][0]["logprobs"]["tokens"] == lp["tokens"] and chunks[1]["choices"][0]["finish_reason"]
    refused = httpx.post(stack.http + "/v1/completions", json={**body, "echo": False, "max_tokens": 0}, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"


def test_echoed_prompt_logprobs_repeated_past_the_bound_are_refused_before_any_work(stack, model_name):  # noqa: F811
    """Attack (2026-12-07): each of n choices repeats its prompt's logprobs; 8 prompts of 1,000 ids with n 32 and
    20 alternatives (a 41 KB body) made a 491 MB response and held the gateway's event loop for 39 s. Expected: 400
    naming ``echo`` (``prompt_logprobs`` when that asked), at once, past 64 entries per context token (524,288);
    one such prompt with n 1 is served."""
    ids = [100 + i for i in range(1000)]
    body = {"model": model_name, "prompt": [ids] * 8, "n": 32, "echo": True, "logprobs": 20, "max_tokens": 1}
    started = time.monotonic()
    refused = httpx.post(stack.http + "/v1/completions", json=body, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "echo", refused.text
    assert "10752000 entries" in refused.json()["error"]["message"] and time.monotonic() - started < 10
    scored = httpx.post(stack.http + "/v1/completions", timeout=60, json={
        "model": model_name, "prompt": ids, "n": 25, "max_tokens": 1, "prompt_logprobs": 20})  # 525,000 entries
    assert scored.status_code == 400 and scored.json()["error"]["param"] == "prompt_logprobs", scored.text
    assert "n = 25 choices" in scored.json()["error"]["message"]
    one = httpx.post(stack.http + "/v1/completions", json={**body, "prompt": ids, "n": 1}, timeout=60)
    assert one.status_code == 200 and len(one.json()["choices"][0]["logprobs"]["top_logprobs"]) == 1001


def assert_continuous_usage(chunks: list[dict], num_choices: int, prompt_tokens: int, tokens_each: int) -> None:
    """Every chunk with a choice carries the usage so far of that choice (vLLM's layout); the last
    one counts all of its tokens; the usage chunk counts every choice's."""
    final = chunks.pop()
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == num_choices * tokens_each
    so_far: dict[int, list[int]] = {}
    for chunk in chunks:
        (choice,) = chunk["choices"]
        usage = chunk["usage"]
        assert usage["prompt_tokens"] == prompt_tokens == final["usage"]["prompt_tokens"]
        assert usage["total_tokens"] == prompt_tokens + usage["completion_tokens"]
        so_far.setdefault(choice["index"], []).append(usage["completion_tokens"])
    assert sorted(so_far) == list(range(num_choices))
    for counts in so_far.values():
        assert counts == sorted(counts) and counts[-1] == tokens_each and len(set(counts)) > 1


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(stack, model_name):  # noqa: F811
    options = {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    fields = {"model": model_name, "max_tokens": 5, "temperature": 1.0, "seed": 3, "ignore_eos": True, "n": 2}
    chunks = streamed_chunks(stack.http, "/v1/completions", {**fields, "prompt": PROMPTS[0], **options})
    prompt_tokens = len(httpx.post(stack.http + "/tokenize", json={"prompt": PROMPTS[0]}, timeout=60).json()["tokens"])
    assert_continuous_usage(chunks, 2, prompt_tokens, 5)
    messages = [{"role": "user", "content": "Hi"}]
    chunks = streamed_chunks(stack.http, "/v1/chat/completions", {**fields, "messages": messages, **options})
    prompt_tokens = len(httpx.post(stack.http + "/tokenize", json={"messages": messages}, timeout=60).json()["tokens"])
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant" and chunks[0]["usage"]["completion_tokens"] == 0
    assert_continuous_usage(chunks, 2, prompt_tokens, 5)
    whole = httpx.post(stack.http + "/v1/completions", timeout=60, json={**fields, "prompt": "Hi", **options})
    assert whole.status_code == 400 and whole.json()["error"]["param"] == "stream_options"


def test_chat_logprob_bytes_of_pieces_of_a_character_are_the_tokens_own(stack, client, model_name):  # noqa: F811
    word = "日本語"  # the default tokenizer writes each of these characters in two or three byte-level pieces
    answer = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "Say 'Japanese' in Japanese."}], temperature=0,
        max_tokens=12, logprobs=True, top_logprobs=1, extra_body={"structured_outputs": {"choice": [word]}})
    choice = answer.choices[0]
    assert choice.message.content == word
    content = choice.logprobs.content
    assert any(c.token == "\ufffd" for c in content)  # pieces of a character, shown as U+FFFD...
    assert b"".join(bytes(c.bytes) for c in content).startswith(word.encode())  # ...but their bytes are their own
    for entry in content:  # greedy under the grammar: the top alternative is the chosen token
        assert entry.top_logprobs[0].token == entry.token and entry.top_logprobs[0].bytes == entry.bytes


def test_chat_answer_without_tool_calls_has_no_tool_calls_key(stack, model_name):  # noqa: F811
    body = {"model": model_name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0}
    message = httpx.post(stack.http + "/v1/chat/completions", json=body, timeout=120).json()["choices"][0]["message"]
    assert message["role"] == "assistant" and message["content"] and "tool_calls" not in message
