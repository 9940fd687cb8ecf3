"""`pagedserve up`: Redis (if none answers), the schedulers, N workers and the gateway as child processes."""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from urllib.parse import urlparse

import grpc

from pagedserve.services.common.auth import cluster_channel
from pagedserve.services.common.grpc_server import check_health
from pagedserve.services.common.pb import engine_pb2 as pb
from pagedserve.services.common.pb import engine_pb2_grpc
from pagedserve.config_flags import config_to_argv
from pagedserve.local_redis import REDIS_PORT, redis_answers, redis_settings, write_secret_file
from pagedserve.stack_config import StackConfig
from pagedserve.stack_ports import LOCAL_HOSTS
from pagedserve.services.common.service_args import redact_url


STOP_TIMEOUT_S = 15.0
"""How long `pagedserve up` waits for each child to exit after SIGTERM before it kills it, seconds."""

GATEWAY_SHUTDOWN_GRACE_S = 10.0
"""The gateway's ``--shutdown-grace-s`` under `pagedserve up`: with the gateway's closing time
(``SHUTDOWN_CLOSE_S``) it fits in ``STOP_TIMEOUT_S``."""


class LaunchError(RuntimeError):
    """The stack did not come up (a child exited, or it was not healthy in time)."""


class StartStopped(LaunchError):
    """A stop was requested (Ctrl-C) before the stack was up."""


class Stack:
    """The child processes of one `pagedserve up`, started in order and stopped together."""

    def __init__(self, config: StackConfig) -> None:
        self.config = config
        self.redis_url = config.redis_url
        """The URL the services use: ``config.redis_url``, with ``config.redis_password`` when we started
        a Redis for a URL without a password."""
        self.generated_redis_password = False
        """Whether the Redis we started requires ``config.redis_password`` (see ``redis_password_file``)."""
        self.children: list[tuple[str, subprocess.Popen]] = []
        self._specs: dict[str, tuple[list[str], dict[str, str] | None, str]] = {}
        self._restarts: dict[str, list[float]] = {}
        self._stop = threading.Event()

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None, stdin_text: str = "") -> None:
        process = spawn_child(argv, env, stdin_text)
        self._specs[name] = (argv, env, stdin_text)
        self.children = [(n, p) for n, p in self.children if n != name] + [(name, process)]

    def _service(self, name: str, *args: str) -> None:
        """A pagedserve service; its secrets travel in the environment, where only this user can read them."""
        env = {**os.environ, "PAGEDSERVE_REDIS_URL": self.redis_url,
               "PAGEDSERVE_CLUSTER_TOKEN": self.config.cluster_token}
        env.pop("PAGEDSERVE_API_KEY", None)
        if name == "gateway" and self.config.api_key:
            env["PAGEDSERVE_API_KEY"] = self.config.api_key
        self._spawn(name, service_argv(*args), env)

    def start(self, stop: threading.Event | None = None) -> None:
        """Starts every process and waits until the stack serves, or until ``stop`` is set.

        Raises:
            StartStopped: ``stop`` was set before the stack was up.
            LaunchError: a process exited, or the stack was not ready within the timeout.
        """
        self._stop = stop or self._stop
        cfg = self.config
        self._start_redis()
        policy, speculative = config_to_argv(cfg.policy), config_to_argv(cfg.speculative_config)
        for name, address in cfg.scheduler_addresses().items():
            self._service(name, "scheduler", "--host", "127.0.0.1", "--port", address.rsplit(":", 1)[1],
                          "--consumer-name", name, *policy, *speculative, *self._metrics_flag(name))
        for i in range(cfg.workers):
            self._service(
                f"worker-{i}", "worker", "--model", str(cfg.model), "--host", "127.0.0.1", "--port", "0",
                "--block-size", str(cfg.policy.block_size), "--num-threads", str(cfg.threads_per_worker),
                *config_to_argv(cfg.runner), *speculative, *self._cores_of(i), *self._metrics_flag(f"worker-{i}"),
            )
        self._service(
            "gateway", "gateway", "--model", str(cfg.model), "--host", cfg.host, "--port", str(cfg.port),
            "--http-port", str(cfg.http_port), "--shutdown-grace-s", str(GATEWAY_SHUTDOWN_GRACE_S),
            *self._metrics_flag("gateway"),
        )
        self._wait_ready()

    def _metrics_flag(self, name: str) -> list[str]:
        port = self.config.metrics_ports().get(name)
        return [] if port is None else ["--metrics-port", str(port)]

    def _cores_of(self, worker_index: int) -> list[str]:
        """``--cpu-affinity`` giving each worker its own cores, when they fit on this machine."""
        threads = self.config.threads_per_worker
        if self.config.workers * threads > (os.cpu_count() or 1):
            return []
        first = worker_index * threads
        return ["--cpu-affinity", f"{first}-{first + threads - 1}"]

    def _start_redis(self) -> None:
        """Starts a local redis-server unless one answers at the URL already; it requires a password
        (the URL's, else a new one, see ``StackConfig.redis_password``)."""
        cfg = self.config
        if redis_answers(cfg.redis_url):
            return
        url = urlparse(cfg.redis_url)
        if url.hostname not in LOCAL_HOSTS:
            raise LaunchError(f"no Redis answers at {redact_url(cfg.redis_url)}, and it is not a local address to "
                              "start one on")
        binary = shutil.which("redis-server")
        if binary is None:
            raise LaunchError("redis-server is not installed (Debian: apt-get install -y redis-server)")
        cfg.data_dir.mkdir(parents=True, exist_ok=True)
        cfg.data_dir.chmod(0o700)  # its append-only file holds every queued prompt
        if url.password is None:
            url = url._replace(netloc=f":{cfg.redis_password}@{url.netloc.rpartition('@')[2]}")
            self.redis_url = url.geturl()
            self.generated_redis_password = True
            write_secret_file(cfg.redis_password_file, cfg.redis_password)
        # "-": the settings come on stdin, so that a password never shows in `ps`
        self._spawn("redis", [binary, "-"], stdin_text=redis_settings(url.port or REDIS_PORT, cfg.data_dir, url))
        self._wait(lambda: redis_answers(self.redis_url), "redis-server", 30)

    def _wait_ready(self) -> None:
        cfg = self.config
        schedulers = list(cfg.scheduler_addresses().values())
        self._wait(lambda: all(check_health(s) for s in schedulers), "the scheduler(s)", cfg.startup_timeout_s)
        self._wait(lambda: sum(num_workers(s, cfg.cluster_token) for s in schedulers) >= cfg.workers,
                   f"{cfg.workers} worker(s)", cfg.startup_timeout_s)
        self._wait(lambda: check_health(cfg.gateway_address(cfg.port)), "the gateway", cfg.startup_timeout_s)

    def _wait(self, ready, what: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            if self._stop.is_set():
                raise StartStopped(f"stopped while waiting for {what}")
            self.check_children()
            if time.monotonic() > deadline:
                raise LaunchError(f"{what} not ready after {timeout_s:.0f} s")
            time.sleep(0.25)

    def check_children(self) -> None:
        """Raises LaunchError if any child has exited."""
        for name, process in self.children:
            if process.poll() is not None:
                raise LaunchError(f"{name} exited with status {process.returncode}")

    def restart_exited(self) -> None:
        """Starts again every child that exited (the others keep serving meanwhile: a worker's
        sequences are recomputed on the rest).

        Raises:
            LaunchError: a child exited ``MAX_RESTARTS`` times within a minute.
        """
        now = time.monotonic()
        for name, process in list(self.children):
            if process.poll() is None:
                continue
            recent = [t for t in self._restarts.get(name, []) if now - t < 60] + [now]
            if len(recent) > MAX_RESTARTS:
                raise LaunchError(f"{name} keeps exiting (status {process.returncode}, {MAX_RESTARTS} restarts "
                                  "within a minute); see its output above")
            self._restarts[name] = recent
            print(f"pagedserve up: {name} exited with status {process.returncode}; starting it again",
                  file=sys.stderr, flush=True)
            self._spawn(name, *self._specs[name])

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM to every child (gateway first, Redis last), then SIGKILL what is left after
        ``timeout_s`` seconds (each)."""
        for _, process in reversed(self.children):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


MAX_RESTARTS = 5
"""Restarts of one child within a minute after which `pagedserve up` gives up."""


def service_argv(*args: str) -> list[str]:
    """The command line of a service under `up`: this Python with ``-P``, so the folder `up` was started
    in is not on the service's import path (``python -m`` puts it first: a ``redis.py`` or ``grpc/`` there
    would replace that dependency in every service). The service imports pagedserve as installed (a wheel or
    ``pip install -e``, as scripts/setup.sh does), or from ``PYTHONPATH``, which it inherits."""
    return [sys.executable, "-P", "-m", "pagedserve", *args]


PR_SET_PDEATHSIG = 1
"""``prctl`` option: the signal a process gets when the thread that started it ends (Linux, prctl(2))."""


def spawn_child(argv: list[str], env: dict[str, str] | None = None, stdin_text: str = "") -> subprocess.Popen:
    """Starts a child of `pagedserve up` in a session of its own (a Ctrl-C in the terminal reaches `up`
    alone, which stops the children in order), writing ``stdin_text`` to its standard input. On Linux the
    child gets SIGTERM when `up` ends in any way, a SIGKILL or the OOM killer included (``PR_SET_PDEATHSIG``):
    no stack is left running with nobody to stop it. Call it from the thread that lives as long as `up`
    (the signal follows the thread that started the child)."""
    parent = os.getpid()
    prctl = getattr(ctypes.CDLL(None, use_errno=True), "prctl", None) if sys.platform == "linux" else None

    def die_with_parent() -> None:  # in the child, between fork and exec
        prctl(PR_SET_PDEATHSIG, ctypes.c_ulong(signal.SIGTERM))  # prctl(2) reads an unsigned long
        if os.getppid() != parent:  # `up` died before the line above: nothing would signal the child
            os._exit(1)

    process = subprocess.Popen(argv, start_new_session=True, env=env, stdin=subprocess.PIPE if stdin_text else None,
                               text=bool(stdin_text), preexec_fn=die_with_parent if prctl is not None else None)
    if stdin_text:
        process.stdin.write(stdin_text)
        process.stdin.close()
    return process


def num_workers(scheduler_address: str, cluster_token: str) -> int:
    """Workers the scheduler has registered (0 when it does not answer)."""
    try:
        with cluster_channel(scheduler_address, cluster_token) as channel:
            stats = engine_pb2_grpc.SchedulerStub(channel).GetStats(pb.GetStatsRequest(), timeout=2)
        return len(stats.workers)
    except grpc.RpcError:
        return 0


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
