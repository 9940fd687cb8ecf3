"""The main command, `pagedserve up`, and the streaming client `pagedserve complete`, as a user runs them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jsonschema
import pytest
import redis

from pagedserve.services.common.grpc_server import check_health
from tests.e2e.ports import free_port
from tests.e2e.processes import cache_dir

pytestmark = [pytest.mark.e2e, pytest.mark.model]


def pagedserve(*args: str, env: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagedserve", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


API_KEY = "cli-api-key-77e1"
GATEWAY_HOST = "127.0.0.2"
"""`up --host`: a loopback address other than 127.0.0.1, where the gateway alone listens (up waited on 127.0.0.1
for a gateway given another address, and timed out with the stack serving)."""


@pytest.fixture(scope="module")
def up(tmp_path_factory, small_model):
    """`pagedserve up` with an API key given through the environment, starting its own Redis (which
    gets a password up makes, as it makes the cluster token), its gateway on ``GATEWAY_HOST``."""
    tmp = cache_dir(tmp_path_factory.mktemp("up"))  # the C++ op shared: not built again (25 s)
    port, scheduler_port, redis_port, http_port = free_port(), free_port(), free_port(), free_port()
    env = {**os.environ, "PAGEDSERVE_CACHE_DIR": str(tmp), "PYTHONUNBUFFERED": "1", "PAGEDSERVE_API_KEY": API_KEY,
           "PAGEDSERVE_REDIS_URL": f"redis://127.0.0.1:{redis_port}/0"}
    env.pop("PAGEDSERVE_CLUSTER_TOKEN", None)  # up makes one
    log = open(tmp / "up.log", "w+")
    process = subprocess.Popen(
        [sys.executable, "-m", "pagedserve", "up", "--workers", "1", "--schedulers", "2", "--port", str(port),
         "--http-port", str(http_port), "--host", GATEWAY_HOST,
         "--scheduler-port", str(scheduler_port), "--model", str(small_model), "--kv-cache-memory", "64MiB",
         "--metrics-port", "0"],  # no fixed metrics ports: tests run side by side
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
    )
    deadline = time.monotonic() + 300
    while "pagedserve is up" not in (tmp / "up.log").read_text():
        assert process.poll() is None, (tmp / "up.log").read_text()
        assert time.monotonic() < deadline, "pagedserve up did not come up"
        time.sleep(0.5)
    yield {"process": process, "target": f"{GATEWAY_HOST}:{port}", "env": env, "log": tmp / "up.log", "cache_dir": tmp,
           "ports": (port, scheduler_port, redis_port), "http": f"http://{GATEWAY_HOST}:{http_port}"}
    if process.poll() is None:
        process.terminate()  # up stops its services; SIGKILL would leave them running as orphans
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)


CAPITAL = ("complete", "--chat", "--prompt", "What is the capital of France?", "--temperature", "0",
           "--max-tokens", "24")
"""A greedy chat completion; up serves the small random-weight model (its answer is the offline engine's, not
Paris: the default model's answer is checked by tests/e2e/test_cli_first_minutes.py and test_auth.py)."""


@pytest.fixture(scope="module")
def capital_offline(up, small_model) -> str:
    """What `pagedserve complete --offline` prints for ``CAPITAL``: what up's stack must stream."""
    result = pagedserve(*CAPITAL, "--offline", "--model", str(small_model), env=up["env"])
    assert result.returncode == 0 and result.stdout.strip(), result.stderr
    return result.stdout


def test_complete_streams_text_from_the_stack(up, capital_offline):
    result = pagedserve(*CAPITAL, "--target", up["target"], env=up["env"])
    assert result.returncode == 0, result.stderr
    assert result.stdout == capital_offline


def test_the_commands_up_prints_reach_its_gateway(up):
    log = up["log"].read_text()
    assert f"pagedserve complete --target {up['target']} --chat" in log
    assert f"curl {up['http']}/v1/chat/completions" in log


def test_up_runs_two_schedulers(up):
    """``--schedulers 2``: both listen (ports PORT and PORT+1); the gateway streams from whichever owns the worker."""
    _, scheduler_port, _ = up["ports"]
    assert "(2 scheduler(s), 1 worker(s)" in up["log"].read_text()
    assert check_health(f"127.0.0.1:{scheduler_port}") and check_health(f"127.0.0.1:{scheduler_port + 1}")


def test_complete_json_matches_offline(up, small_model):
    args = ["complete", "--chat", "--prompt", "Name a planet.", "--temperature", "0", "--max-tokens", "12", "--json"]
    online = json.loads(pagedserve(*args, "--target", up["target"], env=up["env"]).stdout)
    offline = json.loads(pagedserve(*args, "--offline", "--model", str(small_model), env=up["env"]).stdout)
    assert set(online) == {"text", "token_ids", "finish_reason", "usage"}
    assert online == offline
    assert online["usage"]["completion_tokens"] == len(online["token_ids"]) > 0
    assert online["finish_reason"] in ("stop", "length")


def test_complete_tool_calls_match_offline(up, small_model):
    """`--tools` with a named `--tool-choice`: the call comes out (`--json`'s tool_calls, the text
    empty), validates, and the in-process engine parses the same call."""
    from tests.e2e.test_tool_calls import TIME, TOOLS

    args = ["complete", "--chat", "--prompt", "What time is it in Paris?", "--temperature", "0", "--max-tokens", "40",
            "--json", "--tools", json.dumps(TOOLS), "--tool-choice", "get_time"]
    online = json.loads(pagedserve(*args, "--target", up["target"], env=up["env"]).stdout)
    offline = json.loads(pagedserve(*args, "--offline", "--model", str(small_model), env=up["env"]).stdout)
    assert online["finish_reason"] == "tool_calls" and online["text"] == "", online
    (call,) = online["tool_calls"]
    assert call["name"] == "get_time" and call["id"].startswith("call_")
    jsonschema.validate(json.loads(call["arguments"]), TIME)
    assert [{**c, "id": ""} for c in offline.pop("tool_calls")] == [{**call, "id": ""}]
    assert offline == {key: value for key, value in online.items() if key != "tool_calls"}


def test_up_prints_and_serves_the_openai_api(up, small_model):
    import httpx

    assert f"OpenAI API: {up['http']}/v1" in up["log"].read_text()
    headers = {"Authorization": f"Bearer {API_KEY}"}
    models = httpx.get(up["http"] + "/v1/models", headers=headers, timeout=30).json()
    assert [m["id"] for m in models["data"]] == [small_model.name]
    assert httpx.get(up["http"] + "/v1/models", timeout=30).status_code == 401


def test_the_openai_client_against_up_matches_grpc_and_hf(up, small_model):
    """The unmodified `openai` package against `pagedserve up`: greedy text streamed and whole
    equal, equal to the gRPC API's and to HF greedy; top-5 logprobs equal HF's log_softmax within
    1e-4; n=3; a stop string; the usage chunk."""
    import torch
    from openai import OpenAI
    from transformers import AutoModelForCausalLM, AutoTokenizer

    client = OpenAI(base_url=up["http"] + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    name, prompt, max_tokens = small_model.name, "The three primary colors are", 12
    greedy = dict(model=name, prompt=prompt, max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**greedy, logprobs=5)
    chunks = list(client.completions.create(**greedy, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == max_tokens
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    grpc_json = json.loads(pagedserve("complete", "--target", up["target"], "--prompt", prompt, "--temperature", "0",
                                      "--max-tokens", str(max_tokens), "--ignore-eos", "--json", env=up["env"]).stdout)
    assert grpc_json["text"] == whole.choices[0].text

    tokenizer = AutoTokenizer.from_pretrained(str(small_model))
    hf = AutoModelForCausalLM.from_pretrained(str(small_model), torch_dtype=torch.float32).eval()
    ids = torch.tensor([tokenizer(prompt)["input_ids"]])
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                          pad_token_id=2, eos_token_id=None)
        hf_logprobs = torch.log_softmax(hf(out).logits[0, ids.shape[1] - 1:-1].float(), dim=-1)  # (max_tokens, vocab)
    assert out[0, ids.shape[1]:].tolist() == grpc_json["token_ids"]
    got = whole.choices[0].logprobs
    for position, token_id in enumerate(grpc_json["token_ids"]):
        assert got.token_logprobs[position] == pytest.approx(hf_logprobs[position, token_id].item(), abs=1e-4)
        hf_top = hf_logprobs[position].topk(5).values.tolist()
        assert sorted(got.top_logprobs[position].values(), reverse=True) == pytest.approx(hf_top, abs=1e-4)

    several = client.completions.create(model=name, prompt=prompt, max_tokens=8, temperature=0.8, seed=7, n=3)
    assert sorted(c.index for c in several.choices) == [0, 1, 2]
    assert all(c.text and c.finish_reason in ("stop", "length") for c in several.choices)
    assert 3 <= several.usage.completion_tokens <= 24

    messages = [{"role": "user", "content": "List three colors."}]
    free = client.chat.completions.create(model=name, temperature=0, max_tokens=24, messages=messages)
    text = free.choices[0].message.content
    stop = text[6:9]  # a piece of the greedy answer: the answer with it as a stop string ends right before it
    stopped = client.chat.completions.create(model=name, temperature=0, max_tokens=24, messages=messages, stop=[stop])
    assert stopped.choices[0].message.content == text[:text.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"


def test_complete_without_the_api_key_is_refused(up):
    env = {k: v for k, v in up["env"].items() if k != "PAGEDSERVE_API_KEY"}
    result = pagedserve("complete", "--target", up["target"], "--prompt", "Hi", "--max-tokens", "4", env=env)
    assert result.returncode == 1
    assert "UNAUTHENTICATED" in result.stderr


def test_bench_serve_sends_the_api_key(up):
    import asyncio

    from pagedserve.bench.datasets import SampleRequest
    from pagedserve.bench.serve import LoadSettings, run_load

    samples = [SampleRequest("Once upon a time", 4, 3)] * 2

    def errors(api_key: str) -> list:
        records, _ = asyncio.run(run_load(up["target"], samples, LoadSettings(float("inf")), temperature=0.0,
                                          ignore_eos=True, timeout_s=120, api_key=api_key))
        return [r.error for r in records]

    assert errors(API_KEY) == [None, None]
    assert errors("") == ["UNAUTHENTICATED", "UNAUTHENTICATED"]


def _redis_password(up) -> str:
    """The password up made for its Redis (in the file its ready message names)."""
    password_file = up["cache_dir"] / f"redis-{up['ports'][2]}" / "redis-password"
    assert f"password in {password_file}" in up["log"].read_text()  # how to connect, without the password
    assert password_file.stat().st_mode & 0o077 == 0
    return password_file.read_text().strip()


def test_secrets_are_not_in_the_command_lines_of_ups_children(up):
    children = subprocess.run(["pgrep", "-P", str(up["process"].pid)], capture_output=True, text=True).stdout.split()
    assert len(children) == 5  # redis-server, two schedulers, worker, gateway
    cmdlines = [Path(f"/proc/{pid}/cmdline").read_bytes() for pid in children]
    prefix = b"PAGEDSERVE_CLUSTER_TOKEN="
    tokens = {entry[len(prefix):] for pid in children for entry in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
              if entry.startswith(prefix)}
    assert len(tokens) == 1  # one token, shared by the services through their environment
    token = tokens.pop()
    assert len(token) == 64
    assert sum(b"redis-server" in c for c in cmdlines) == 1
    password = _redis_password(up)
    for cmdline in cmdlines:
        assert token not in cmdline
        assert password.encode() not in cmdline and API_KEY.encode() not in cmdline
    assert password not in up["log"].read_text()


def test_up_starts_its_redis_with_a_password_it_makes(up):
    """Given a Redis URL without a password, up's own Redis still requires one (issue #20); the
    stack serves through it (the other tests of this module)."""
    password = _redis_password(up)
    assert len(password) == 48
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(host="127.0.0.1", port=up["ports"][2]).ping()
    assert redis.Redis(host="127.0.0.1", port=up["ports"][2], password=password).ping()


def test_complete_reports_server_errors_by_status_name(up):
    result = pagedserve("complete", "--target", up["target"], "--prompt", "Hi", "--top-p", "2", env=up["env"])
    assert result.returncode == 1
    assert "INVALID_ARGUMENT" in result.stderr and "sampling_params.top_p" in result.stderr


def test_up_starts_a_crashed_worker_again(up, capital_offline):
    """A worker killed under `up` no longer takes the whole stack down (issue #9 review)."""
    children = subprocess.run(["pgrep", "-P", str(up["process"].pid)], capture_output=True, text=True).stdout.split()
    [worker] = [pid for pid in children if b"\0worker\0" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    os.kill(int(worker), signal.SIGKILL)
    restarted = "worker-0 exited with status -9; starting it again"
    deadline = time.monotonic() + 30
    while restarted not in up["log"].read_text():
        assert time.monotonic() < deadline, up["log"].read_text()[-3000:]
        time.sleep(0.5)
    assert up["process"].poll() is None
    # Asked before the new worker is admitted, the request would wait for it, but only until the
    # scheduler's no-worker limit (30 s from the kill) ends it with UNAVAILABLE: under CI's load a
    # worker's start (model, C++ op) has taken longer than that.
    deadline = time.monotonic() + 120
    while "admitted with" not in up["log"].read_text().split(restarted, 1)[1]:
        assert time.monotonic() < deadline and up["process"].poll() is None, up["log"].read_text()[-3000:]
        time.sleep(0.5)
    result = pagedserve(*CAPITAL, "--target", up["target"], env=up["env"])
    assert result.returncode == 0 and result.stdout == capital_offline, result.stderr


def test_ctrl_c_stops_every_process(up):
    process = up["process"]
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=60) == 0, up["log"].read_text()
    port, scheduler_port, _ = up["ports"]
    assert not check_health(f"{GATEWAY_HOST}:{port}") and not check_health(f"127.0.0.1:{scheduler_port}")
    leftovers = subprocess.run(["pgrep", "-f", f"--port {scheduler_port}"], capture_output=True, text=True).stdout
    assert leftovers.strip() == ""

