"""What a new user meets in the first minutes (issue #24): a second `pagedserve up` beside a running
one, flags that do not apply, a bad model folder, a stream cut by an error, the clients' defaults."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pagedserve.cli import build_parser
from pagedserve.stack_config import StackConfig
from tests.e2e.ports import free_port
from tests.e2e.processes import cache_dir

pytestmark = [pytest.mark.e2e, pytest.mark.model]


def pagedserve(*args: str, env: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagedserve", *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


def start_up(argv: list[str], env: dict, log_path: Path) -> subprocess.Popen:
    """`pagedserve up ARGV`, once it says it is up (its output in ``log_path``)."""
    log = open(log_path, "w")
    process = subprocess.Popen([sys.executable, "-m", "pagedserve", "up", *argv], stdout=log,
                               stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 300
    while "pagedserve is up" not in log_path.read_text():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"pagedserve up did not come up:\n{log_path.read_text()[-3000:]}")
        time.sleep(0.5)
    return process


def stop(process: subprocess.Popen) -> int:
    process.send_signal(signal.SIGINT)
    try:
        return process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait()


@pytest.fixture(scope="module")
def first(tmp_path_factory, default_model):
    """A running `pagedserve up` on free ports, starting its own Redis."""
    tmp = tmp_path_factory.mktemp("first")
    ports = {"port": free_port(), "http": free_port(), "scheduler": free_port(), "metrics": free_port(),
             "redis": free_port()}
    env = {**os.environ, "PAGEDSERVE_CACHE_DIR": str(cache_dir(tmp)), "PYTHONUNBUFFERED": "1",
           "PAGEDSERVE_REDIS_URL": f"redis://127.0.0.1:{ports['redis']}/0"}
    for name in ("PAGEDSERVE_CLUSTER_TOKEN", "PAGEDSERVE_API_KEY", "PAGEDSERVE_MODEL"):
        env.pop(name, None)
    argv = ["--port", str(ports["port"]), "--http-port", str(ports["http"]), "--scheduler-port",
            str(ports["scheduler"]), "--metrics-port", str(ports["metrics"]), "--model", str(default_model),
            "--kv-cache-memory", "64MiB"]
    process = start_up(argv, env, tmp / "up.log")
    yield {"argv": argv, "env": env, "ports": ports, "tmp": tmp, "target": f"127.0.0.1:{ports['port']}"}
    stop(process)


def test_a_second_up_beside_a_running_one_says_so_and_starts_nothing(first):
    password_file = first["tmp"] / f"redis-{first['ports']['redis']}" / "redis-password"
    password = password_file.read_text()
    started = time.monotonic()
    result = pagedserve("up", *first["argv"], env=first["env"], timeout=120)
    assert result.returncode == 1, result.stderr
    assert time.monotonic() - started < 30  # nothing was started and waited for
    output = result.stdout + result.stderr
    assert f"127.0.0.1:{first['ports']['port']} (gateway gRPC)" in output
    assert "A pagedserve stack (another `pagedserve up`) is probably running" in output
    assert re.search(r"pagedserve up --port-offset \d+", output)
    assert "redis-server" not in output.lower() and "E0000" not in output and "listener" not in output
    assert password_file.read_text() == password  # the first stack's Redis password file is untouched
    serving = pagedserve("complete", "--target", first["target"], "--prompt", "Hi", "--max-tokens", "2",
                         env=first["env"])
    assert serving.returncode == 0, serving.stderr


def test_the_port_offset_suggested_starts_a_second_stack_with_its_own_redis(first, tmp_path):
    message = pagedserve("up", *first["argv"], env=first["env"], timeout=120).stderr
    offset = int(re.search(r"--port-offset (\d+)", message).group(1))
    env = {**first["env"], "PAGEDSERVE_CACHE_DIR": str(cache_dir(tmp_path))}
    second = start_up([*first["argv"], "--port-offset", str(offset)], env, tmp_path / "up.log")
    try:
        log = (tmp_path / "up.log").read_text()
        assert f"Redis: 127.0.0.1:{first['ports']['redis'] + offset}," in log  # its own Redis, started by it
        assert f"gRPC API:   127.0.0.1:{first['ports']['port'] + offset}" in log
        result = pagedserve("complete", "--target", f"127.0.0.1:{first['ports']['port'] + offset}", "--chat",
                            "--prompt", "What is the capital of France?", "--temperature", "0", "--max-tokens", "12",
                            env=env)
        assert result.returncode == 0 and "Paris" in result.stdout, result.stderr
    finally:
        assert stop(second) == 0


def test_complete_refuses_model_flags_without_offline(first):
    """The gateway serves its stack's model: `--model X` against it was silently ignored."""
    result = pagedserve("complete", "--target", first["target"], "--prompt", "Hi", "--model", "/some/other/model",
                        env=first["env"])
    assert result.returncode == 2 and result.stdout == ""
    assert "--model applies only with --offline" in result.stderr


def test_a_stream_cut_by_an_error_prints_the_error_on_its_own_line(first):
    # 4000 tokens take minutes on a CPU, so a 10 s deadline cuts the stream; a 3 s one could expire before
    # the first token on a busy 2-core CI machine (nothing came: one clean-clone run on an AVX2 EPYC)
    process = subprocess.run([sys.executable, "-m", "pagedserve", "complete", "--target", first["target"],
                              "--prompt", "Once upon a time", "--ignore-eos", "--max-tokens", "4000",
                              "--timeout", "10"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env=first["env"], timeout=60)
    assert process.returncode == 1
    text, _, error = process.stdout.rpartition("error: DEADLINE_EXCEEDED")
    assert text.strip() and text.endswith("\n"), process.stdout  # text came, then the error on a line of its own
    assert error.strip()


def test_up_checks_the_model_folder_before_starting_anything(tmp_path):
    redis_port = free_port()
    env = {**os.environ, "PAGEDSERVE_CACHE_DIR": str(tmp_path), "PAGEDSERVE_REDIS_URL": f"redis://127.0.0.1:{redis_port}/0"}
    result = pagedserve("up", "--model", str(tmp_path / "no-such-model"), "--port", str(free_port()), env=env,
                        timeout=60)
    assert result.returncode == 2
    assert "no-such-model is not a folder; --model takes a Hugging Face model folder" in result.stderr
    assert not (tmp_path / f"redis-{redis_port}").exists()  # no Redis was started


def test_health_and_complete_default_to_the_gateway_of_up():
    parser = build_parser()
    up_port = StackConfig.__dataclass_fields__["port"].default
    assert parser.parse_args(["health"]).target == f"127.0.0.1:{up_port}"
    assert parser.parse_args(["complete", "--prompt", "x"]).target == f"127.0.0.1:{up_port}"
