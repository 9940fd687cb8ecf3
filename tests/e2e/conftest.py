"""A real stack for the end-to-end tests: redis-server, 1 scheduler, 2 workers, 1 gateway."""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest

from services.common.model_files import prepare_default_model
from tests.e2e.processes import Process, free_port, healthy, pagedserve, scheduler_stats, start_redis, wait_until


@dataclass
class Stack:
    redis_url: str
    gateway: str
    scheduler: str
    processes: dict[str, Process]

    def logs(self) -> str:
        return "\n".join(f"==== {name}\n{p.log_text()[-3000:]}" for name, p in self.processes.items())


def start_stack(tmp_path, model, num_workers: int = 2, kv_cache_memory: str = "64MiB", env_extra: dict | None = None) -> Stack:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env_extra or {})}
    redis_proc, redis_url = start_redis(tmp_path)
    processes = {"redis": redis_proc}
    sched_port, gw_port = free_port(), free_port()
    scheduler = f"127.0.0.1:{sched_port}"
    common = ["--redis-url", redis_url]
    try:
        processes["scheduler"] = pagedserve("scheduler", ["scheduler", *common, "--host", "127.0.0.1",
                                                          "--port", str(sched_port)], tmp_path, env)
        for i in range(num_workers):
            processes[f"worker-{i}"] = pagedserve(
                f"worker-{i}",
                ["worker", *common, "--model", str(model), "--host", "127.0.0.1", "--port", "0",
                 "--kv-cache-memory", kv_cache_memory, "--num-threads", "1", "--worker-id", f"worker-{i}"],
                tmp_path, env,
            )
        processes["gateway"] = pagedserve("gateway", ["gateway", *common, "--model", str(model), "--host", "127.0.0.1",
                                                      "--port", str(gw_port), "--scheduler", scheduler], tmp_path, env)
        procs = list(processes.values())
        wait_until(lambda: healthy(scheduler), "scheduler", 120, procs)
        wait_until(lambda: len(scheduler_stats(scheduler).workers) == num_workers, "workers", 300, procs)
        wait_until(lambda: healthy(f"127.0.0.1:{gw_port}"), "gateway", 120, procs)
    except Exception:
        for p in processes.values():
            p.stop()
        raise
    return Stack(redis_url, f"127.0.0.1:{gw_port}", scheduler, processes)


@pytest.fixture(scope="session")
def default_model():
    return prepare_default_model()


@pytest.fixture(scope="session")
def stack(tmp_path_factory, default_model):
    # Spans are printed to each service's log, so the tracing test can follow one request.
    s = start_stack(tmp_path_factory.mktemp("stack"), default_model, env_extra={"OTEL_TRACES_EXPORTER": "console"})
    yield s
    for name, p in reversed(list(s.processes.items())):
        p.stop()


@pytest.fixture(scope="session")
def offline_outputs(default_model):
    """Greedy outputs of the in-process engine for QUESTIONS (the reference for the stack)."""
    from pagedserve.llm import LLM
    from services.common.sampling_params import SamplingParams
    from services.gateway.tokenizer import ChatTurn

    llm = LLM(default_model, kv_cache_memory="64MiB")
    params = SamplingParams(max_tokens=24, temperature=0.0)
    from tests.e2e.test_stack import QUESTIONS

    results = llm.chat([[ChatTurn("user", q)] for q in QUESTIONS], params)
    return {q: r for q, r in zip(QUESTIONS, results)}
