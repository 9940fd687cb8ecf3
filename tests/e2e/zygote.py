"""Service processes for the tests, forked from a template process that has imported them already.

A service started as ``python -m pagedserve <service> ...`` spends most of its start importing: of a
stack's ~12 CPU-s (2026-12-06, AVX2 EPYC), a worker's ~4.2 (3 of them torch), a gateway's 2.7 (2.4 of
them its modules and transformers), a scheduler's 0.8 (0.6); the suite starts ~35 stacks. A
:class:`Template` imports those modules once (one template per pytest process and load-time
environment, started at its first use); each service is then forked from it and runs pagedserve's
``__main__`` as ``python -m pagedserve`` would: the same argv, environment, working directory, log
file, exit status (the template reaps its children and reports each one's), ``atexit`` handlers and
interpreter shutdown. :func:`start` hands back a :class:`ForkedProcess`, which has the
``subprocess.Popen`` methods the tests use.

What a forked service does not repeat is the import: module-level code ran in the template, under its
environment. So only a service whose environment matches the template's in everything but the
variables read at run time (``RUN_TIME_PREFIXES``; the project reads its own only when a service
starts) shares a template; libgomp, for one, reads ``OMP_*`` when torch loads. ``pagedserve up``, the
CLI tests, run.sh and the compose check still start every service with exec, as a user does.
``PAGEDSERVE_TESTS_EXEC_SERVICES=1`` starts every test service with exec too (to compare).
"""

from __future__ import annotations

import json
import os
import queue
import select
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

RUN_TIME_PREFIXES = ("PAGEDSERVE_", "OTEL_", "PYTEST_")
"""Environment variables that a service reads when it starts, not when its modules are imported:
they may differ between a template and the services forked from it."""

PRELOADED = ("pagedserve.cli", "services.scheduler.server", "services.worker.server", "services.gateway.server")
"""The modules every service's start imports (torch with the worker's, grpc with all of them)."""

_templates: dict[frozenset, "Template"] = {}
_templates_lock = threading.Lock()


def start(argv: list[str], log_path: Path, env: dict[str, str] | None) -> "ForkedProcess | subprocess.Popen":
    """``argv`` (``[sys.executable, "-m", "pagedserve", ...]``) forked from the template for ``env``,
    its output appended to ``log_path`` (``env`` None: this process's); other commands, and every one under
    ``PAGEDSERVE_TESTS_EXEC_SERVICES=1``, started with exec (``subprocess.Popen``)."""
    if argv[:3] != [sys.executable, "-m", "pagedserve"] or os.environ.get("PAGEDSERVE_TESTS_EXEC_SERVICES") == "1":
        with open(log_path, "ab") as log:
            return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
    env = dict(os.environ) if env is None else env
    load_time = frozenset((k, v) for k, v in env.items() if not k.startswith(RUN_TIME_PREFIXES))
    with _templates_lock:
        template = _templates.get(load_time)
        if template is None or not template.alive():
            template = _templates[load_time] = Template(dict(load_time))
    return template.fork(argv, log_path, env)


class ForkedProcess:
    """A service forked by a :class:`Template`, with the ``subprocess.Popen`` API the tests use
    (``pid``, ``returncode``, ``poll``, ``wait``, ``send_signal``, ``terminate``, ``kill``). Signals go
    through a pidfd, so none reaches another process that took the pid after the template reaped it."""

    def __init__(self, template: "Template", pid: int, args: list[str]) -> None:
        self.pid = pid
        self.args = args
        self._template = template
        try:
            self._pidfd: int | None = os.pidfd_open(pid)
        except ProcessLookupError:  # exited and reaped already
            self._pidfd = None

    @property
    def returncode(self) -> int | None:
        return self._template.exit_status(self.pid, timeout_s=0)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """The exit status (``-N``: killed by signal N).

        Raises:
            subprocess.TimeoutExpired: still running after ``timeout`` seconds.
        """
        status = self._template.exit_status(self.pid, timeout_s=timeout)
        if status is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return status

    def send_signal(self, sig: int) -> None:
        if self.returncode is None and self._pidfd is not None:
            try:
                signal.pidfd_send_signal(self._pidfd, sig)
            except ProcessLookupError:  # exited and reaped, its status on its way
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __del__(self) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)


class Template:
    """A process that has imported ``PRELOADED`` under ``env`` and forks services on request
    (``python -m tests.e2e.zygote FD``: JSON lines over a socket pair, both ways).

    Raises:
        RuntimeError: the template did not get ready within 300 s (its log is in the message).
    """

    def __init__(self, env: dict[str, str]) -> None:
        ours, theirs = socket.socketpair()
        self._log = Path(os.environ.get("TMPDIR", "/tmp")) / f"pagedserve-test-template-{os.getpid()}-{id(self)}.log"
        with open(self._log, "wb") as log:
            self._popen = subprocess.Popen([sys.executable, "-m", "tests.e2e.zygote", str(theirs.fileno())],
                                           pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, stdout=log,
                                           stderr=subprocess.STDOUT, env=env)
        theirs.close()
        self._sock = ours
        self._lock = threading.Lock()
        self._replies: queue.Queue[dict] = queue.Queue()
        self._exits: dict[int, int] = {}
        self._ended = threading.Condition()
        self._gone = False
        threading.Thread(target=self._read, name="template-reader", daemon=True).start()
        self._reply(300)

    def alive(self) -> bool:
        return not self._gone

    def fork(self, argv: list[str], log_path: Path, env: dict[str, str]) -> ForkedProcess:
        request = {"argv": argv[3:], "log": str(log_path), "env": env, "cwd": os.getcwd()}
        with self._lock:
            self._sock.sendall(json.dumps(request).encode() + b"\n")
            return ForkedProcess(self, self._reply(60)["pid"], argv)

    def exit_status(self, pid: int, timeout_s: float | None) -> int | None:
        """``pid``'s exit status, waiting up to ``timeout_s`` (None: for ever); None while it runs.

        Raises:
            RuntimeError: the template died, so the status will never come.
        """
        with self._ended:
            self._ended.wait_for(lambda: pid in self._exits or self._gone, timeout_s)
            if pid not in self._exits and self._gone:
                raise RuntimeError(f"the test services' template process died; its log: {self._log}")
            return self._exits.get(pid)

    def _reply(self, timeout_s: float) -> dict:
        try:
            reply = self._replies.get(timeout=timeout_s)
        except queue.Empty:
            reply = {"error": f"no answer in {timeout_s} s"}
        if "error" in reply:
            raise RuntimeError(f"test services' template: {reply['error']}; its log:\n"
                               f"{self._log.read_text(errors='replace')[-3000:]}")
        return reply

    def _read(self) -> None:
        for line in self._sock.makefile("rb"):
            message = json.loads(line)
            if "exited" in message:
                with self._ended:
                    self._exits[message["exited"]] = message["status"]
                    self._ended.notify_all()
            else:
                self._replies.put(message)
        with self._ended:
            self._gone = True
            self._ended.notify_all()
        self._replies.put({"error": "the template process ended"})


def _serve(sock_fd: int) -> dict | None:
    """The template's loop: imports ``PRELOADED``, says ready, then forks one child per request and
    reports each child's exit status when it ends. Returns only in a forked child (the request it is
    to run), or with None when the test process closes the socket."""
    import importlib

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
                return None
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
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
    job = _serve(int(sys.argv[1]))
    if job is not None:
        import runpy

        _become(job)
        runpy.run_module("pagedserve", run_name="__main__", alter_sys=True)
