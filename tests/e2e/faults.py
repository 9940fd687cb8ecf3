"""Faults and their checks for the end-to-end fault tests (tests/e2e/test_chaos.py, test_scheduler_migration.py):
replacing a stack's processes (kill -9, restarts on the same port), streaming clients on their own
threads, the checks that every stream ended as allowed and nothing leaked, and ``SharedStack``: one
stack that several faults take turns on."""

from __future__ import annotations

import contextlib
import itertools
import shutil
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import redis

from pagedserve.services.common import redis_keys
from pagedserve.services.common.pb import generate_pb2 as gen
from pagedserve.services.common.pb import generate_pb2_grpc
from tests.e2e.processes import Process, Stack, healthy, pagedserve, scheduler_stats, start_stack, wait_until
from tests.e2e.test_stack import QUESTIONS, chat_request

STREAM_BOUND_S = 120.0
"""Every stream ends (completes or fails with a clear status) within this long of the fault."""
RECOVERY_BOUND_S = 60.0
"""A new request succeeds within this long of the fault (restarts included)."""

_instances = itertools.count(1)
"""Numbers the logs of replaced and replacement processes (unique in a shared stack's folder)."""


# ---- processes ---------------------------------------------------------------------------------

@contextlib.contextmanager
def own_stack(tmp_path, model, num_workers: int = 1, scheduler_args: tuple[str, ...] = ()):
    """A stack for one test (``start_stack`` with one-thread workers); its logs are printed if the test fails."""
    stack = start_stack(tmp_path, model, num_workers=num_workers, worker_threads=1, scheduler_args=scheduler_args)
    try:
        with logs_on_failure(stack):
            yield stack
    finally:
        stack.stop()


@contextlib.contextmanager
def logs_on_failure(stack: Stack):
    try:
        yield
    except BaseException:
        print(stack.logs())
        raise


def kill(stack: Stack, role: str) -> None:
    """kill -9 the process of ``role``: it says goodbye to no one. It stays in the stack under
    ``ROLE-killed-N`` (stopped with the rest; its log kept)."""
    proc = stack.processes.pop(role)
    proc.popen.send_signal(signal.SIGKILL)
    proc.popen.wait()
    proc.stop()
    stack.processes[f"{role}-killed-{next(_instances)}"] = proc


def _replacement(stack: Stack, role: str, argv: list[str], log_dir: Path) -> Process:
    proc = pagedserve(f"{role}-{next(_instances)}", argv, log_dir, stack.env)
    stack.processes[role] = proc
    return proc


def start_worker(stack: Stack, model, worker_id: str, log_dir) -> Process:
    """A new worker process (role ``worker_id``) with that --worker-id, one thread on core 0."""
    return _replacement(stack, worker_id, [
        "worker", "--redis-url", stack.redis_url, "--model", str(model), "--host", "127.0.0.1", "--port", "0",
        "--kv-cache-memory", "64MiB", "--num-threads", "1", "--worker-id", worker_id, "--cpu-affinity", "0"], log_dir)


def start_scheduler(stack: Stack, log_dir) -> Process:
    """A new scheduler (role ``scheduler``, default flags) on the stack's scheduler port, consumer ``scheduler-0``."""
    port = stack.scheduler.rsplit(":", 1)[1]
    return _replacement(stack, "scheduler", ["scheduler", "--redis-url", stack.redis_url, "--host", "127.0.0.1",
                                             "--port", port, "--consumer-name", "scheduler-0"], log_dir)


def start_gateway(stack: Stack, model, log_dir, gateway_id: str = "") -> Process:
    """A new gateway (role ``gateway``) on the stack's gateway port, with ``gateway_id`` if given."""
    port = stack.gateway.rsplit(":", 1)[1]
    same_id = ["--gateway-id", gateway_id] if gateway_id else []
    argv = ["gateway", "--redis-url", stack.redis_url, "--model", str(model), "--host", "127.0.0.1", "--port", port,
            "--http-port", "0", *same_id]
    return _replacement(stack, "gateway", argv, log_dir)


def start_redis_on(stack: Stack, log_dir) -> Process:
    """A new, empty redis-server (role ``redis``) on the port of the stack's Redis URL."""
    port = stack.redis_url.rsplit(":", 1)[1].split("/")[0]
    name = f"redis-{next(_instances)}"
    data_dir = Path(log_dir) / name
    data_dir.mkdir()
    proc = Process(name, [shutil.which("redis-server"), "--bind", "127.0.0.1", "--port", port, "--save", "",
                          "--appendonly", "no", "--dir", str(data_dir)], log_dir)
    stack.processes["redis"] = proc
    return proc


# ---- clients -----------------------------------------------------------------------------------

@dataclass
class Call:
    """One streaming Generate call on its own thread and channel."""

    index: int
    request: gen.GenerateRequest
    token_ids: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    finish_reason: int = 0
    completion_tokens: int = 0
    code: grpc.StatusCode | None = None
    details: str = ""
    ended_at: float | None = None
    decoding: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None

    def run(self, target: str) -> None:
        try:
            with grpc.insecure_channel(target) as channel:
                for r in generate_pb2_grpc.GenerationStub(channel).Generate(self.request, timeout=STREAM_BOUND_S):
                    self.token_ids.extend(r.token_ids)
                    self.texts.append(r.text)
                    self.times.append(time.monotonic())
                    if len(self.token_ids) >= 2:
                        self.decoding.set()
                    if r.finish_reason:
                        self.finish_reason = r.finish_reason
                        self.completion_tokens = r.usage.completion_tokens
        except grpc.RpcError as exc:
            self.code, self.details = exc.code(), exc.details()
        finally:
            self.ended_at = time.monotonic()
            self.decoding.set()


def start_streams(target: str, max_tokens: list[int], rounds: int = 3) -> list[Call]:
    """Greedy chat streams (ignore_eos) of ``QUESTIONS[i]`` with ``max_tokens[i]`` tokens; returns once each
    decodes, none ended. A round where one completed before another decoded (a new worker's first chunks
    beside decodes are small: under the suite's load one stream's 100 tokens once came first) is joined and
    started again, up to ``rounds``. Raises AssertionError: a stream failed or had no token in 120 s, or
    every round had one end early."""
    for _ in range(rounds):
        calls = [Call(i, chat_request(QUESTIONS[i], max_tokens=m, ignore_eos=True)) for i, m in enumerate(max_tokens)]
        for call in calls:
            call.thread = threading.Thread(target=call.run, args=(target,), daemon=True)
            call.thread.start()
        for call in calls:
            assert call.decoding.wait(120), f"stream {call.index} produced no tokens"
        assert all(c.code is None for c in calls), [(c.index, c.code, c.details) for c in calls if c.code]
        if all(c.ended_at is None for c in calls):
            return calls
        print("a stream ended before every stream decoded (tokens each: "
              f"{[len(c.token_ids) for c in calls]}); starting the streams again")
        for call in calls:
            call.thread.join(STREAM_BOUND_S)
    raise AssertionError(f"in each of {rounds} rounds a stream ended before every stream decoded")


def finish_streams(calls: list[Call], reference: list[list[int]], fault_at: float,
                   allowed: set[grpc.StatusCode]) -> dict:
    """Joins every stream (a hang fails) and checks each: reference tokens exactly, or an allowed status."""
    for call in calls:
        call.thread.join(max(0.0, fault_at + STREAM_BOUND_S + 5 - time.monotonic()))
        assert not call.thread.is_alive(), f"stream {call.index} still running {STREAM_BOUND_S} s after the fault"
    completed, failed = 0, {}
    for call in calls:
        expected = reference[call.index]
        if call.code is None:
            assert call.token_ids == expected, (
                f"stream {call.index}: {len(call.token_ids)} tokens, reference {len(expected)}; "
                f"first difference at {next((i for i, (a, b) in enumerate(zip(call.token_ids, expected)) if a != b), None)}")
            assert call.finish_reason == gen.FINISH_REASON_LENGTH and call.completion_tokens == len(expected)
            completed += 1
        else:
            assert call.code in allowed, f"stream {call.index} failed with {call.code}: {call.details}"
            assert call.code not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL)
            n = min(len(call.token_ids), len(expected))  # greedy: a longer run starts with the reference
            assert call.token_ids[:n] == expected[:n], f"stream {call.index}: wrong tokens before failing"
            failed[call.code.name] = failed.get(call.code.name, 0) + 1
    gaps = [b - a for c in calls for a, b in zip(c.times, c.times[1:])]
    ends = [c.ended_at - fault_at for c in calls]
    return {"completed_identical": completed, "failed": failed or "none",
            "last_stream_end_s": round(max(ends), 2), "longest_token_gap_s": round(max(gaps, default=0.0), 2)}


def probe(target: str, since: float, bound_s: float = RECOVERY_BOUND_S) -> float:
    """Sends short requests until one completes; seconds from ``since`` to that success."""
    deadline = since + bound_s
    attempts, last = 0, None
    while time.monotonic() < deadline:
        attempts += 1
        try:
            with grpc.insecure_channel(target) as channel:
                request = chat_request(QUESTIONS[3], max_tokens=4)
                timeout = max(1.0, min(30.0, deadline - time.monotonic()))
                responses = list(generate_pb2_grpc.GenerationStub(channel).Generate(request, timeout=timeout))
            if responses and responses[-1].finish_reason:
                return round(time.monotonic() - since, 2)
        except grpc.RpcError as exc:
            last = f"{exc.code().name}: {exc.details()}"
            assert exc.code() not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL), last
        time.sleep(0.25)
    raise AssertionError(f"no new request succeeded within {bound_s} s ({attempts} attempts; last: {last})")


def blocks_free(stack: Stack) -> bool:
    stats = scheduler_stats(stack.scheduler)
    return stats.num_running == 0 and stats.num_waiting == 0 and all(
        w.num_free_blocks == w.num_blocks for w in stats.workers)


def redis_clean(stack: Stack) -> bool:
    client = redis.Redis.from_url(stack.redis_url)
    try:
        pending = client.xpending(redis_keys.REQUEST_STREAM, redis_keys.SCHEDULER_GROUP)["pending"]
        return pending == 0 and client.xlen(redis_keys.REQUEST_STREAM) == 0
    finally:
        client.close()


def assert_no_leak(stack: Stack, num_workers: int, timeout_s: float = 30.0) -> None:
    wait_until(lambda: len(scheduler_stats(stack.scheduler).workers) == num_workers, f"{num_workers} worker(s)", 30)
    wait_until(lambda: blocks_free(stack), "every KV block free, nothing running or waiting", timeout_s)
    wait_until(lambda: redis_clean(stack), "no request entry left in Redis", 10)


def stack_settled(stack: Stack, num_workers: int) -> bool:
    """Serving, ``num_workers`` workers known, nothing running or waiting, every block free, Redis clean."""
    try:
        return healthy(stack.gateway) and len(scheduler_stats(stack.scheduler).workers) == num_workers \
            and blocks_free(stack) and redis_clean(stack)
    except (grpc.RpcError, redis.RedisError):
        return False


@dataclass
class SharedStack:
    """One one-worker stack with the services' default flags that the faults which leave a whole stack
    behind (processes restarted on their ports, paused ones resumed) take turns on: a stack start costs
    ~10 CPU-s and ~6 s. A turn begins on a settled stack (``stack_settled``, waited for ``SETTLE_S``). A
    failed turn's stack is stopped, so the next turn starts a fresh one and a failure stays in its own
    test; a stack that a passing turn left does not settle fails the next turn (a leak that turn's checks
    missed) and is replaced.

    Args:
        log_dir: a folder for the stacks' logs (one subfolder each).
        model: the model folder.
    """

    log_dir: Path
    model: Path
    stack: Stack | None = None
    folder: Path | None = None
    """The current stack's log folder (where replacement processes log too)."""
    _log_starts: dict[str, int] = field(default_factory=dict)

    SETTLE_S = 30.0

    @contextlib.contextmanager
    def turn(self):
        """Yields the settled stack; prints its logs and stops it if the turn fails.

        Raises:
            AssertionError: the stack the previous (passing) turn left did not settle within ``SETTLE_S``.
        """
        if self.stack is not None and not _within(self.SETTLE_S, lambda: stack_settled(self.stack, 1)):
            print(self.stack.logs())
            self.stop()
            raise AssertionError(f"the stack the previous turn left did not settle within {self.SETTLE_S} s "
                                 "(serving, one worker, nothing running or waiting, every block free, Redis clean)")
        if self.stack is None:
            self.folder = self.log_dir / f"stack-{next(_instances)}"
            self.folder.mkdir()
            self.stack = start_stack(self.folder, self.model, num_workers=1, worker_threads=1)
        self._log_starts = {p.name: len(p.log_text()) for p in self.stack.processes.values()}
        try:
            with logs_on_failure(self.stack):
                yield self.stack
        except BaseException:
            self.stop()
            raise

    def log_of_this_turn(self, role: str) -> str:
        """The log the process of ``role`` wrote during the current turn (all of it if it started in it)."""
        proc = self.stack.processes[role]
        return proc.log_text()[self._log_starts.get(proc.name, 0):]

    def stop(self) -> None:
        if self.stack is not None:
            self.stack.stop()
            self.stack = None


def _within(timeout_s: float, ready) -> bool:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.25)
    return True
