"""Real processes for integration tests: redis-server on a free loopback port, pagedserve services."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pagedserve.model_files import default_cache_dir
from pagedserve.services.common.auth import cluster_channel
from pagedserve.services.common.grpc_server import check_health
from pagedserve.services.common.pb import engine_pb2 as pb
from pagedserve.services.common.pb import engine_pb2_grpc
from pagedserve.services.common.signed_records import RecordCheck
from tests.e2e import zygote
from tests.e2e.ports import free_port

CLUSTER_TOKEN = secrets.token_hex(32)
"""The cluster token of every stack the tests start (services get it as PAGEDSERVE_CLUSTER_TOKEN)."""

RECORDS = RecordCheck(CLUSTER_TOKEN)
"""Signs (and checks) records in Redis as the services of the tests' stacks do."""


def wait_until(ready: Callable[[], bool], what: str, timeout_s: float, processes: list["Process"] = ()) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        for p in processes:
            p.check_alive()
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not ready after {timeout_s} s")
        time.sleep(0.2)


class Process:
    """A child process whose output goes to a log file (shown when it dies unexpectedly); a pagedserve
    service is forked from a template that has imported it (``tests/e2e/zygote.py``)."""

    def __init__(self, name: str, argv: list[str], log_dir: Path, env: dict | None = None) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "wb")
        self.popen = zygote.start(argv, self.log_path, env)
        self._terminated = False

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def check_alive(self) -> None:
        if self.popen.poll() is not None:
            raise RuntimeError(f"{self.name} exited with {self.popen.returncode}:\n{self.log_text()[-4000:]}")

    def terminate(self) -> None:
        """Sends SIGTERM once (a second one could cut a graceful shutdown short)."""
        if self.popen.poll() is None and not self._terminated:
            self.popen.terminate()
            self._terminated = True

    def stop(self, timeout_s: float = 15.0) -> int:
        if self.popen.poll() is None:
            self.terminate()
            try:
                self.popen.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        self._log.close()
        return self.popen.returncode


def stop_all(processes: dict[str, Process]) -> None:
    """Stops every process: SIGTERM to all services at once, so that their graceful shutdowns overlap
    (one stack: about 2.6 s instead of 4.3 s one after another), then Redis (named ``redis...``)
    last, so the services can still say goodbye to it."""
    services = [p for name, p in processes.items() if not name.startswith("redis")]
    for p in services:
        p.terminate()
    for p in services:
        p.stop()
    for name, p in processes.items():
        if name.startswith("redis"):
            p.stop()


def start_redis(log_dir: Path) -> tuple[Process, str]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed; run scripts/setup.sh")
    port = free_port()
    proc = Process("redis", [binary, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
                             "--dir", str(log_dir)], log_dir)
    url = f"redis://127.0.0.1:{port}/0"
    import redis

    def answers() -> bool:
        try:
            return bool(redis.Redis.from_url(url).ping())
        except redis.RedisError:
            return False

    wait_until(answers, "redis-server", 20, [proc])
    return proc, url


def pagedserve(name: str, args: list[str], log_dir: Path, env: dict | None = None) -> Process:
    return Process(name, [sys.executable, "-m", "pagedserve", *args], log_dir, env)


def http_health(base_url: str) -> int:
    """The status of ``GET /health`` at an HTTP API's base URL (0 when it does not answer)."""
    import httpx

    try:
        return httpx.get(base_url + "/health", timeout=5).status_code
    except httpx.HTTPError:
        return 0


def gateway_in_flight(http: str) -> int:
    """Requests in flight in the gateway whose HTTP API is at ``http`` (its /metrics)."""
    import httpx

    text = httpx.get(http + "/metrics", timeout=5).text
    lines = [line for line in text.splitlines() if line.startswith("pagedserve_gateway_requests_in_flight")]
    return int(float(lines[0].split()[-1])) if lines else 0


def start_gateway(name: str, stack: "Stack", model: Path, log_dir: Path, args: tuple[str, ...] = (),
                  env_extra: dict | None = None) -> tuple[Process, str, str]:
    """Another gateway on ``stack`` (with ``args`` added to its flags), once its HTTP health is 200.
    Returns the process, its gRPC address and its HTTP base URL."""
    port, http_port = free_port(), free_port()
    process = pagedserve(name, ["gateway", "--redis-url", stack.redis_url, "--model", str(model), "--host", "127.0.0.1",
                                "--port", str(port), "--http-port", str(http_port), *args],
                         log_dir, {**stack.env, **(env_extra or {})})
    http = f"http://127.0.0.1:{http_port}"
    try:
        wait_until(lambda: http_health(http) == 200, name, 120, [process])
    except BaseException:
        process.stop()
        raise
    return process, f"127.0.0.1:{port}", http


def thread_cores(pid: int) -> list[str]:
    """Each thread's allowed CPUs in process ``pid`` (``Cpus_allowed_list`` of /proc, e.g. ``"0"``, ``"0-1"``)."""
    return [next(line.split()[1] for line in (task / "status").read_text().splitlines()
                 if line.startswith("Cpus_allowed_list:")) for task in Path(f"/proc/{pid}/task").iterdir()]


def scheduler_stats(address: str, cluster_token: str = CLUSTER_TOKEN) -> pb.SchedulerStats:
    with cluster_channel(address, cluster_token) as channel:
        return engine_pb2_grpc.SchedulerStub(channel).GetStats(pb.GetStatsRequest(), timeout=5)


def num_workers_known(address: str) -> int:
    """Workers the scheduler at ``address`` knows; -1 while it does not answer (it is starting or
    gone; the caller asks again)."""
    import grpc

    try:
        return len(scheduler_stats(address).workers)
    except grpc.RpcError:
        return -1


def stranger_server(add_servicer, servicer) -> tuple["grpc.Server", int]:
    """A started gRPC server without the cluster token's check on a free loopback port, serving
    ``servicer`` (added with ``add_servicer``, e.g. ``add_WorkerServicer_to_server``): someone posing
    as a service. Returns it and its port."""
    import grpc
    from concurrent.futures import ThreadPoolExecutor

    server = grpc.server(ThreadPoolExecutor(2))
    add_servicer(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


def status_of(call: Callable[[], object]) -> "grpc.StatusCode":
    """The status a gRPC call made by ``call()`` fails with (the test fails if it succeeds)."""
    import grpc
    import pytest

    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code()


def healthy(address: str) -> bool:
    return check_health(address)


@dataclass
class Stack:
    redis_url: str
    gateway: str
    scheduler: str
    processes: dict[str, Process]
    env: dict[str, str]
    """The services' environment (holds the cluster token), for starting more of them."""
    metrics: dict[str, str] = field(default_factory=dict)
    """Service name (scheduler, worker-0, ..., gateway) -> host:port of its ``/metrics``."""
    http: str = ""
    """Base URL of the gateway's OpenAI-compatible HTTP API (``http://127.0.0.1:PORT``)."""

    def stop(self) -> None:
        """Stops every process of the stack (:func:`stop_all`)."""
        stop_all(self.processes)

    def logs(self) -> str:
        return "\n".join(f"==== {name}\n{p.log_text()[-3000:]}" for name, p in self.processes.items())


def start_stack(tmp_path, model, num_workers: int = 2, kv_cache_memory: str = "64MiB", env_extra: dict | None = None,
                worker_threads: int = 1, scheduler_args: tuple[str, ...] = (), worker_args: tuple[str, ...] = (),
                gateway_args: tuple[str, ...] = (), workers_per_process: int = 1) -> Stack:
    """Starts redis-server, a scheduler (``scheduler_args`` are added to its flags, e.g.
    ``["--step-timeout", "3"]``), ``num_workers`` workers (with ``worker_args`` added) and a gateway
    (with ``gateway_args`` added; its HTTP API on a free port, ``Stack.http``), and waits until all are up
    (``workers_per_process`` registered workers per worker process: a pipeline's virtual engines)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PAGEDSERVE_CLUSTER_TOKEN": CLUSTER_TOKEN, **(env_extra or {})}
    redis_proc, redis_url = start_redis(tmp_path)
    processes = {"redis": redis_proc}
    sched_port, gw_port, http_port = free_port(), free_port(), free_port()
    scheduler = f"127.0.0.1:{sched_port}"
    metrics = {name: f"127.0.0.1:{free_port()}" for name in ["scheduler", *(f"worker-{i}" for i in range(num_workers)),
                                                              "gateway"]}

    def metrics_port(name: str) -> list[str]:
        return ["--metrics-port", metrics[name].rsplit(":", 1)[1]]
    common = ["--redis-url", redis_url]
    try:
        processes["scheduler"] = pagedserve("scheduler", ["scheduler", *common, "--host", "127.0.0.1",
                                                          "--port", str(sched_port), "--consumer-name", "scheduler-0",
                                                          *metrics_port("scheduler"),
                                                          *scheduler_args], tmp_path, env)
        bind = num_workers * worker_threads <= (os.cpu_count() or 1)
        for i in range(num_workers):
            cores = ["--cpu-affinity", f"{i * worker_threads}-{(i + 1) * worker_threads - 1}"] if bind else []
            processes[f"worker-{i}"] = pagedserve(
                f"worker-{i}",
                ["worker", *common, "--model", str(model), "--host", "127.0.0.1", "--port", "0",
                 "--kv-cache-memory", kv_cache_memory, "--num-threads", str(worker_threads), "--worker-id", f"worker-{i}", *cores,
                 *metrics_port(f"worker-{i}"), *worker_args],
                tmp_path, env,
            )
        processes["gateway"] = pagedserve("gateway", ["gateway", *common, "--model", str(model), "--host", "127.0.0.1",
                                                      "--port", str(gw_port), "--http-port", str(http_port),
                                                      *metrics_port("gateway"), *gateway_args],
                                                     tmp_path, env)
        procs = list(processes.values())
        wait_until(lambda: healthy(scheduler), "scheduler", 120, procs)
        wait_until(lambda: num_workers_known(scheduler) == num_workers * workers_per_process, "workers", 300, procs)
        wait_until(lambda: healthy(f"127.0.0.1:{gw_port}"), "gateway", 120, procs)
        # the HTTP health flag follows the gRPC one within a second (its watcher polls)
        wait_until(lambda: http_health(f"http://127.0.0.1:{http_port}") == 200, "gateway HTTP health", 30, procs)
    except BaseException:  # a KeyboardInterrupt too: no process left behind
        stop_all(processes)
        raise
    return Stack(redis_url, f"127.0.0.1:{gw_port}", scheduler, processes, env, metrics=metrics,
                 http=f"http://127.0.0.1:{http_port}")


def cache_dir(folder: Path) -> Path:
    """``folder`` as a PAGEDSERVE_CACHE_DIR (up keeps its Redis there) sharing the C++ op already built."""
    ops = default_cache_dir() / "ops"
    ops.mkdir(parents=True, exist_ok=True)
    (folder / "ops").symlink_to(ops, target_is_directory=True)
    return folder
