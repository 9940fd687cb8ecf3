"""The stack of the several-schedulers tests (``test_scheduler_migration.py``): two schedulers with short leases,
two workers pinned to a core each, a gateway, all real processes; and what those tests read of it."""

from __future__ import annotations

import contextlib
import os
import re
import threading
import urllib.request

from pagedserve.services.common.pb import generate_pb2 as gen
from tests.e2e.faults import Call
from tests.e2e.ports import free_port
from tests.e2e.processes import (CLUSTER_TOKEN, Stack, healthy, num_workers_known, pagedserve, scheduler_stats,
                                 start_redis, stop_all, wait_until)

KV_CACHE = "256MiB"
"""Per worker: room for all the streams at once with the admission headroom (64 MiB, 91 blocks, held the
prompts but kept later streams queued for the running ones' growth, so one ended before the fault)."""
LEASE_TTL_S = 2.0


@contextlib.contextmanager
def two_schedulers(tmp_path, model, lease_ttl_s: float = LEASE_TTL_S):
    """redis-server, schedulers s0 and s1 (``--lease-ttl lease_ttl_s``), workers w0 and w1 (one core each), a
    gateway; waits until each scheduler owns one worker. Yields the stack (its ``metrics`` addresses by process
    name) and the scheduler addresses by name."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PAGEDSERVE_CLUSTER_TOKEN": CLUSTER_TOKEN}
    redis_proc, redis_url = start_redis(tmp_path)
    processes = {"redis": redis_proc}
    schedulers = {f"s{i}": f"127.0.0.1:{free_port()}" for i in range(2)}
    metrics = {name: f"127.0.0.1:{free_port()}" for name in ("s0", "s1", "w0", "w1")}
    common = ["--redis-url", redis_url]
    try:
        for name, address in schedulers.items():
            processes[name] = pagedserve(name, ["scheduler", *common, "--host", "127.0.0.1", "--port",
                                                address.rsplit(":", 1)[1], "--consumer-name", name, "--lease-ttl",
                                                str(lease_ttl_s), "--metrics-port", metrics[name].rsplit(":", 1)[1]],
                                         tmp_path, env)
        for i in range(2):
            processes[f"w{i}"] = pagedserve(f"w{i}", [
                "worker", *common, "--model", str(model), "--host", "127.0.0.1", "--port", "0", "--kv-cache-memory",
                KV_CACHE, "--num-threads", "1", "--worker-id", f"w{i}", "--cpu-affinity", str(i % (os.cpu_count() or 1)),
                "--metrics-port", metrics[f"w{i}"].rsplit(":", 1)[1]], tmp_path, env)
        gateway = f"127.0.0.1:{free_port()}"
        processes["gateway"] = pagedserve("gateway", ["gateway", *common, "--model", str(model), "--host", "127.0.0.1",
                                                      "--port", gateway.rsplit(":", 1)[1], "--http-port", "0"],
                                          tmp_path, env)
        procs = list(processes.values())
        for address in schedulers.values():
            wait_until(lambda a=address: healthy(a) and num_workers_known(a) == 1,
                       "each scheduler owning one worker", 300, procs)
        wait_until(lambda: healthy(gateway), "gateway", 120, procs)
        stack = Stack(redis_url, gateway, schedulers["s0"], processes, env, metrics=metrics)
        yield stack, schedulers
    except BaseException:
        print("\n".join(f"==== {n}\n{p.log_text()[-3000:]}" for n, p in processes.items()))
        raise
    finally:
        stop_all(processes)


def metric(address: str, name: str) -> float:
    """Sum of a Prometheus series' samples at ``http://address/metrics`` (0 if absent)."""
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    return sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def run_fresh_requests(target: str, count: int) -> list[Call]:
    """``count`` short requests at once with raw prompts unlike any before (no chat template, whose
    cached prefix would draw them all to one worker); returns them finished."""
    calls = [Call(i, gen.GenerateRequest(prompt=f"{i * 7919} is a number that", sampling_params=gen.SamplingParams(
        max_tokens=8, temperature=0.0))) for i in range(count)]
    for call in calls:
        call.thread = threading.Thread(target=call.run, args=(target,), daemon=True)
        call.thread.start()
    for call in calls:
        call.thread.join(120)
        assert not call.thread.is_alive(), f"request {call.index} still running after 120 s"
    return calls


def settled(address: str, num_workers: int) -> bool:
    stats = scheduler_stats(address)
    return (len(stats.workers) == num_workers and stats.num_running == 0 and stats.num_waiting == 0
            and all(w.num_free_blocks == w.num_blocks for w in stats.workers))


def busier_scheduler(schedulers: dict[str, str]) -> tuple[str, str, str]:
    """(the scheduler running or queueing more requests, the other, the id of the busier one's only
    worker). Which scheduler reads a request from Redis is a race (a cached chat-template prefix can
    draw all of them to one): a fault on the idle one's worker would move nothing."""
    stats = {name: scheduler_stats(address) for name, address in schedulers.items()}
    owner = max(stats, key=lambda name: stats[name].num_running + stats[name].num_waiting)
    assert stats[owner].num_running + stats[owner].num_waiting > 0, "neither scheduler runs a stream"
    assert len(stats[owner].workers) == 1, stats[owner].workers
    return owner, next(s for s in schedulers if s != owner), stats[owner].workers[0].worker_id


def steps(stack: Stack, worker: str) -> float:
    return metric(stack.metrics[worker], "pagedserve_worker_step_seconds_count")
