"""The template process of ``zygote`` (run as ``python -m tests.e2e.zygote_server FD LOG``): imports
the services' modules once, then forks a child per request that becomes ``python -m pagedserve ARGV``,
and reports each child's exit status. Requests and reports are JSON lines over the socket ``FD``;
``LOG`` is the template's own log (deleted at the end when empty).
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import sys
import threading
from pathlib import Path

PRELOADED = ("pagedserve.cli", "pagedserve.services.scheduler.server", "pagedserve.services.worker.server",
             "pagedserve.services.gateway.server")
"""The modules every service's start imports (torch with the worker's, grpc with all of them)."""


def _serve(sock_fd: int, log_path: str) -> dict | None:
    """The template's loop: imports ``PRELOADED``, says ready, then forks one child per request and
    reports each child's exit status when it ends. Returns only in a forked child (the request it is
    to run), or with None when the test process closes the socket (the log, then empty, is deleted)."""
    import importlib

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C in the terminal is for pytest; the services stop it
    for module in PRELOADED:
        importlib.import_module(module)
    from transformers import AutoTokenizer, TokenizersBackend  # noqa: F401 (the gateway's tokenizer classes)

    if threading.active_count() != 1:
        raise RuntimeError(f"the template started threads {threading.enumerate()}: forking would lose them")
    sock = socket.socket(fileno=sock_fd)
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_read, False)
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    sock.sendall(b'{"ready": true}\n')
    pending = b""
    while True:
        readable, _, _ = select.select([sock, wake_read], [], [])
        if wake_read in readable:
            while _drained(wake_read):
                pass
            _report_exits(sock)
        if sock in readable:
            data = sock.recv(1 << 20)
            if not data:
                if Path(log_path).stat().st_size == 0:
                    Path(log_path).unlink()
                return None
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                try:
                    pid = os.fork()
                except OSError as exc:
                    sock.sendall(json.dumps({"error": f"fork failed: {exc}"}).encode() + b"\n")
                    continue
                if pid == 0:
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a fresh interpreter
                    for fd in (wake_read, wake_write):
                        os.close(fd)
                    sock.close()
                    return request
                sock.sendall(json.dumps({"pid": pid}).encode() + b"\n")


def _drained(fd: int) -> bool:
    try:
        return bool(os.read(fd, 4096))
    except BlockingIOError:
        return False


def _report_exits(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        sock.sendall(json.dumps({"exited": pid, "status": os.waitstatus_to_exitcode(status)}).encode() + b"\n")


def _become(request: dict) -> None:
    """Turns a forked child into ``python -m pagedserve ARGV`` started in ``cwd`` with ``env``, its
    stdin /dev/null and its stdout and stderr appended to ``log`` (line-buffered)."""
    null = os.open(os.devnull, os.O_RDONLY)
    log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(null)
    os.close(log)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.stdin = sys.__stdin__ = open(0, closefd=False)
    sys.stdout = sys.__stdout__ = open(1, "w", buffering=1, closefd=False)
    sys.stderr = sys.__stderr__ = open(2, "w", buffering=1, closefd=False, errors="backslashreplace")
    sys.argv = ["-m", *request["argv"]]


if __name__ == "__main__":
    job = _serve(int(sys.argv[1]), sys.argv[2])
    if job is not None:
        import runpy

        _become(job)
        runpy.run_module("pagedserve", run_name="__main__", alter_sys=True)
