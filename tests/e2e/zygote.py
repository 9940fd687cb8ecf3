"""Service processes for the tests, forked from a template process that has imported them already.

A service started as ``python -m pagedserve <service> ...`` spends most of its start importing: of a
stack's ~12 CPU-s (2026-12-06, AVX2 EPYC), a worker's ~4.2 (3 of them torch), a gateway's 2.7 (2.4 of
them its modules and transformers), a scheduler's 0.8 (0.6); the suite starts ~35 stacks. A
:class:`Template` imports those modules once (one template process, ``zygote_server``, per pytest
process and load-time environment, started at its first use); each service is then forked from it
and runs pagedserve's ``__main__`` as ``python -m pagedserve`` would: the same argv, environment,
working directory, log file, exit status (the template reaps its children and reports each one's),
``atexit`` handlers and interpreter shutdown. :func:`start` hands back a :class:`ForkedProcess`,
which has the ``subprocess.Popen`` methods the tests use.

What a forked service does not repeat is the import, and what imports do: module-level code ran
in the template, under its environment, and threads that imports start (numpy's OpenBLAS pool) are
not in the child until it starts them. So a service shares a template only when its environment
matches the template's in everything but ``RUN_TIME_VARIABLES`` (read when a service starts; the
project reads its own only then, libgomp reads ``OMP_*`` when torch loads, OpenTelemetry
``OTEL_PROPAGATORS`` when imported); a test of what happens at import starts its service with
exec: ``PAGEDSERVE_TESTS_EXEC_SERVICES=1`` in that service's environment (or in the test process's,
for every service). Also different: ``/proc/PID/cmdline`` names the template's command, the string
hash seed is the template's, stdout and stderr are line-buffered. ``pagedserve up``, the CLI tests,
run.sh and the compose check still start every service with exec, as a user does.
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

from tests.e2e import zygote_server

RUN_TIME_VARIABLES = ("PAGEDSERVE_", "PYTEST_", "OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_")
"""Environment variables (names or prefixes) that a service reads when it starts, not when its
modules are imported: they may differ between a template and the services forked from it."""

EXEC_VARIABLE = "PAGEDSERVE_TESTS_EXEC_SERVICES"
"""Set to 1 (in the test process's environment or one service's), services are started with exec."""

UNKNOWN_STATUS = -255
"""The exit status of a service whose template died before reporting it (it exited; how is lost)."""

_templates: dict[frozenset, "Template"] = {}
_templates_lock = threading.Lock()


def start(argv: list[str], log_path: Path, env: dict[str, str] | None) -> "ForkedProcess | subprocess.Popen":
    """``argv`` (``[sys.executable, "-m", "pagedserve", ...]``) forked from the template for ``env``
    (None: this process's), its output appended to ``log_path``; other commands, and services to be
    started with exec (``EXEC_VARIABLE``), started with ``subprocess.Popen``."""
    env = dict(os.environ) if env is None else env
    exec_wanted = "1" in (os.environ.get(EXEC_VARIABLE), env.get(EXEC_VARIABLE))
    if argv[:3] != [sys.executable, "-m", "pagedserve"] or exec_wanted:
        with open(log_path, "ab") as log:
            return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
    load_time = frozenset((k, v) for k, v in env.items() if not k.startswith(RUN_TIME_VARIABLES))
    with _templates_lock:
        template = _templates.get(load_time)
        if template is None or not template.alive():
            template = _templates[load_time] = Template(dict(load_time))
    return template.fork(argv, log_path, env)


class _Child:
    """One forked service's exit status, filled in by the template's reader thread."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.status: int | None = None
        self.ended = threading.Event()


class ForkedProcess:
    """A service forked by a :class:`Template`, with the ``subprocess.Popen`` API the tests use
    (``pid``, ``returncode``, ``poll``, ``wait``, ``send_signal``, ``terminate``, ``kill``). Signals go
    through a pidfd, so none reaches another process that took the pid after the template reaped it;
    should the template die, the pidfd still tells when the service ends (status ``UNKNOWN_STATUS``)."""

    def __init__(self, child: _Child, template: "Template", args: list[str]) -> None:
        self.pid = child.pid
        self.args = args
        self._child = child
        self._template = template
        try:
            self._pidfd: int | None = os.pidfd_open(child.pid)
        except ProcessLookupError:  # exited and reaped already: its status is on its way
            self._pidfd = None

    @property
    def returncode(self) -> int | None:
        return self._status(timeout_s=0)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """The exit status (``-N``: killed by signal N).

        Raises:
            subprocess.TimeoutExpired: still running after ``timeout`` seconds.
        """
        status = self._status(timeout)
        if status is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return status

    def send_signal(self, sig: int) -> None:
        if self._pidfd is not None and not self._child.ended.is_set():
            try:
                signal.pidfd_send_signal(self._pidfd, sig)
            except ProcessLookupError:  # exited and reaped, its status on its way
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _status(self, timeout_s: float | None) -> int | None:
        step_s = 0.2  # how often a wait looks at the template's health
        remaining = timeout_s
        while not self._child.ended.wait(step_s if remaining is None else min(step_s, remaining)):
            if not self._template.alive() and (self._pidfd is None or select.select([self._pidfd], [], [], 0)[0]):
                return UNKNOWN_STATUS  # exited (the pidfd is readable), and its status died with the template
            if remaining is not None:
                remaining -= step_s
                if remaining <= 0:
                    return None
        return self._child.status

    def __del__(self) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)


class Template:
    """A process that has imported ``zygote_server.PRELOADED`` under ``env`` and forks services on
    request (``python -m tests.e2e.zygote_server FD LOG``: JSON lines over a socket pair, both ways).

    Raises:
        RuntimeError: the template did not get ready within 300 s (its log is in the message).
    """

    def __init__(self, env: dict[str, str]) -> None:
        ours, theirs = socket.socketpair()
        self._log = Path(os.environ.get("TMPDIR", "/tmp")) / f"pagedserve-test-template-{os.getpid()}-{id(self)}.log"
        with open(self._log, "wb") as log:
            argv = [sys.executable, "-m", zygote_server.__name__, str(theirs.fileno()), str(self._log)]
            self._popen = subprocess.Popen(argv, pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, stdout=log,
                                           stderr=subprocess.STDOUT, env=env)
        theirs.close()
        self._sock = ours
        self._lock = threading.Lock()
        self._replies: queue.Queue[_Child | str | None] = queue.Queue()
        self._running: dict[int, _Child] = {}
        self._gone = False
        threading.Thread(target=self._read, name="template-reader", daemon=True).start()
        self._reply(300)

    def alive(self) -> bool:
        return not self._gone

    def fork(self, argv: list[str], log_path: Path, env: dict[str, str]) -> ForkedProcess:
        request = {"argv": argv[3:], "log": str(log_path), "env": env, "cwd": os.getcwd()}
        with self._lock:
            self._sock.sendall(json.dumps(request).encode() + b"\n")
            return ForkedProcess(self._reply(60), self, argv)

    def _reply(self, timeout_s: float) -> _Child | None:
        """The next fork's child (None for the ready message).

        Raises:
            RuntimeError: no reply in time (the template is then taken as gone), or an error reply.
        """
        try:
            reply = self._replies.get(timeout=timeout_s)
        except queue.Empty:
            self._gone = True  # a late reply must not answer the next request, nor a late fork run for nobody
            self._popen.kill()
            reply = f"no answer in {timeout_s} s"
        if isinstance(reply, str):
            raise RuntimeError(f"test services' template: {reply}; its log:\n"
                               f"{self._log.read_text(errors='replace')[-3000:]}")
        return reply

    def _read(self) -> None:
        """Reads the template's messages in order: a child's exit always comes before the fork of a
        later child that got its pid (the template reaps before it can fork into that pid)."""
        for line in self._sock.makefile("rb"):
            message = json.loads(line)
            if "exited" in message:
                child = self._running.pop(message["exited"], None)
                if child is not None:
                    child.status = message["status"]
                    child.ended.set()
            elif "pid" in message:
                child = self._running[message["pid"]] = _Child(message["pid"])
                self._replies.put(child)
            else:
                self._replies.put(message["error"] if "error" in message else None)  # None: ready
        self._gone = True
        self._replies.put("the template process ended")
