"""The main command, `pagedserve up`, and the streaming client `pagedserve complete`, as a user runs them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from services.common.grpc_server import check_health
from pagedserve.launcher import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.model]


def pagedserve(*args: str, env: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagedserve", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


@pytest.fixture(scope="module")
def up(tmp_path_factory, default_model):
    tmp = tmp_path_factory.mktemp("up")
    env = {**os.environ, "PAGEDSERVE_CACHE_DIR": str(tmp), "PYTHONUNBUFFERED": "1"}
    port, scheduler_port, redis_port = free_port(), free_port(), free_port()
    log = open(tmp / "up.log", "w+")
    process = subprocess.Popen(
        [sys.executable, "-m", "pagedserve", "up", "--workers", "1", "--port", str(port),
         "--scheduler-port", str(scheduler_port), "--redis-url", f"redis://127.0.0.1:{redis_port}/0",
         "--model", str(default_model), "--kv-cache-memory", "64MiB"],
        stdout=log, stderr=subprocess.STDOUT, env=env,
    )
    deadline = time.monotonic() + 300
    while "pagedserve is up" not in (tmp / "up.log").read_text():
        assert process.poll() is None, (tmp / "up.log").read_text()
        assert time.monotonic() < deadline, "pagedserve up did not come up"
        time.sleep(0.5)
    yield {"process": process, "target": f"127.0.0.1:{port}", "env": env, "log": tmp / "up.log",
           "ports": (port, scheduler_port, redis_port)}
    if process.poll() is None:
        process.kill()


def test_complete_streams_text_from_the_stack(up):
    result = pagedserve("complete", "--target", up["target"], "--chat", "--prompt", "What is the capital of France?",
                        "--temperature", "0", "--max-tokens", "24", env=up["env"])
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


def test_complete_json_matches_offline(up, default_model):
    args = ["complete", "--chat", "--prompt", "Name a planet.", "--temperature", "0", "--max-tokens", "12", "--json"]
    online = json.loads(pagedserve(*args, "--target", up["target"], env=up["env"]).stdout)
    offline = json.loads(pagedserve(*args, "--offline", "--model", str(default_model), env=up["env"]).stdout)
    assert set(online) == {"text", "token_ids", "finish_reason", "usage"}
    assert online == offline
    assert online["usage"]["completion_tokens"] == len(online["token_ids"]) > 0
    assert online["finish_reason"] in ("stop", "length")


def test_complete_reports_server_errors_by_status_name(up):
    result = pagedserve("complete", "--target", up["target"], "--prompt", "Hi", "--top-p", "2", env=up["env"])
    assert result.returncode == 1
    assert "INVALID_ARGUMENT" in result.stderr and "sampling_params.top_p" in result.stderr


def test_ctrl_c_stops_every_process(up):
    process = up["process"]
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=60) == 0, up["log"].read_text()
    port, scheduler_port, _ = up["ports"]
    assert not check_health(f"127.0.0.1:{port}") and not check_health(f"127.0.0.1:{scheduler_port}")
    leftovers = subprocess.run(["pgrep", "-f", f"--port {scheduler_port}"], capture_output=True, text=True).stdout
    assert leftovers.strip() == ""
