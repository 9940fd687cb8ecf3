"""The children of `pagedserve up` end with it, however it ends: a SIGKILL or the OOM killer leaves no
stack running with nobody to stop it (its ports held, "stop it with Ctrl-C where it runs" impossible)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")

SPAWNER = """
import sys, time
from pagedserve.launcher import spawn_child
child = spawn_child(["sleep", "300"], stdin_text="settings\\n")
print(child.pid, flush=True)
time.sleep(300)
"""


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie no one reaped yet counts as ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_child_ends_when_up_is_killed_with_sigkill():
    up = subprocess.Popen([sys.executable, "-c", SPAWNER], stdout=subprocess.PIPE, text=True,
                          cwd=Path(__file__).resolve().parents[1])
    child = int(up.stdout.readline())
    try:
        assert alive(child)
        up.send_signal(signal.SIGKILL)
        up.wait()
        deadline = time.monotonic() + 10
        while alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(child), "the child outlived `up`"
    finally:
        if alive(child):
            os.kill(child, signal.SIGKILL)
