"""`scripts/run.sh` as a user runs it (issue #24): set-up already done is skipped without pip's
output, a completion streams, and Ctrl-C (SIGINT to its process group, as a terminal sends it)
stops the stack and exits 130 without leaving its temporary log behind."""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.e2e.ports import free_port

from pagedserve.model_files import default_cache_dir
from pagedserve.services.common.grpc_server import check_health

pytestmark = [pytest.mark.e2e, pytest.mark.model]

ROOT = Path(__file__).resolve().parents[2]


def read_until(process: subprocess.Popen, marker: str, timeout_s: float) -> str:
    """The process's output up to and including ``marker`` (fails after ``timeout_s``)."""
    selector = selectors.DefaultSelector()
    selector.register(process.stdout, selectors.EVENT_READ)
    output, deadline = b"", time.monotonic() + timeout_s
    while marker.encode() not in output:
        assert time.monotonic() < deadline and selector.select(timeout=max(0.0, deadline - time.monotonic())), \
            output.decode(errors="replace")[-4000:]
        chunk = os.read(process.stdout.fileno(), 65536)
        assert chunk, output.decode(errors="replace")[-4000:]
        output += chunk
    return output.decode(errors="replace")


def start_run_sh(tmp_path: Path, port: int, scheduler_port: int) -> subprocess.Popen:
    """run.sh on free ports in a process group of its own, its TMPDIR ``tmp_path/tmp`` (empty), its
    cache folder sharing the op and the default model already built."""
    subprocess.run([ROOT / "scripts" / "setup.sh"], check=True, capture_output=True)  # what test.sh did
    cache, tmp = tmp_path / "cache", tmp_path / "tmp"
    tmp.mkdir()
    cache.mkdir()
    for shared in ("ops", "models"):
        (default_cache_dir() / shared).mkdir(parents=True, exist_ok=True)
        (cache / shared).symlink_to(default_cache_dir() / shared, target_is_directory=True)
    env = {**os.environ, "PAGEDSERVE_CACHE_DIR": str(cache), "TMPDIR": str(tmp), "PYTHONUNBUFFERED": "1",
           "PAGEDSERVE_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0"}
    for name in ("PAGEDSERVE_CLUSTER_TOKEN", "PAGEDSERVE_API_KEY", "PAGEDSERVE_MODEL", "PAGEDSERVE_PORT"):
        env.pop(name, None)
    return subprocess.Popen([ROOT / "scripts" / "run.sh", "--port", str(port), "--http-port", str(free_port()),
                             "--scheduler-port", str(scheduler_port), "--metrics-port", "0",
                             "--kv-cache-memory", "64MiB"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                            preexec_fn=default_ctrl_c)


def default_ctrl_c() -> None:
    """SIGINT handled as in a terminal's shell: an ignored SIGINT is inherited through exec, and a
    shell started with it ignored cannot trap it (POSIX): run.sh then exits as `up` does (0 once the
    stack ran, 1 while it starts). Two full-suite runs gave exactly those statuses; alone and under a
    busy-loop load both tests pass. What ignores SIGINT in the suite's process was not found: the
    assertion message shows the test process's SigIgn mask."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def ctrl_c(process: subprocess.Popen) -> tuple[int, str]:
    """SIGINT to the process group, as a terminal's Ctrl-C; the exit status and the output after it."""
    try:
        os.killpg(process.pid, signal.SIGINT)
        try:
            status = process.wait(timeout=90)
        except subprocess.TimeoutExpired:  # what still runs, and what it printed (once seen in a full run)
            tree = subprocess.run(["ps", "-o", "pid,ppid,stat,etime,wchan:20,args", "-s", str(process.pid)],
                                  capture_output=True, text=True).stdout
            os.killpg(process.pid, signal.SIGKILL)
            pytest.fail(f"run.sh still ran 90 s after Ctrl-C:\n{tree}\n"
                        + process.stdout.read().decode(errors="replace")[-3000:])
        ignored = [line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("SigIgn")]
        return status, f"{ignored} SIGINT here: {signal.getsignal(signal.SIGINT)}\n" + \
            process.stdout.read().decode(errors="replace")[-3000:]
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def assert_nothing_left(tmp_path: Path, scheduler_port: int) -> None:
    # its temporary log is gone (torch's own cache folder, made when a torch custom op first runs, may stay)
    assert [p for p in (tmp_path / "tmp").iterdir() if not p.name.startswith("torchinductor_")] == []
    assert not check_health(f"127.0.0.1:{scheduler_port}")
    leftovers = subprocess.run(["pgrep", "-f", f"--port {scheduler_port}"], capture_output=True, text=True).stdout
    assert leftovers.strip() == ""


def test_run_sh_skips_done_set_up_streams_and_exits_130_on_ctrl_c_leaving_nothing(tmp_path):
    port, scheduler_port = free_port(), free_port()
    process = start_run_sh(tmp_path, port, scheduler_port)
    try:
        output = read_until(process, "Ctrl-C stops it", 300)
        assert "Python packages: up to date" in output and "Editable installation" not in output
        streamed = output.split(f"== streaming a completion from 127.0.0.1:{port}\n", 1)[1]
        assert "cache" in streamed.split("== the stack keeps running")[0].lower()  # the answer, streamed
    finally:
        status, after = ctrl_c(process)
    assert status == 130, after
    assert_nothing_left(tmp_path, scheduler_port)


def test_ctrl_c_while_the_stack_starts_exits_130_leaving_nothing(tmp_path):
    """Before, Ctrl-C killed tee, `up` went on starting, died writing "pagedserve is up" to the
    closed pipe (exit 1), and run.sh's EXIT trap stopped at that status under `set -e`: exit 1,
    the log left in /tmp."""
    scheduler_port = free_port()
    process = start_run_sh(tmp_path, free_port(), scheduler_port)
    try:
        deadline = time.monotonic() + 180
        while not check_health(f"127.0.0.1:{scheduler_port}"):  # the stack is half started
            assert time.monotonic() < deadline and process.poll() is None
            time.sleep(0.1)
    finally:
        status, after = ctrl_c(process)
    assert status == 130, after
    assert_nothing_left(tmp_path, scheduler_port)
