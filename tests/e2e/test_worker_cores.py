"""``--cpu-affinity``: every thread of a worker runs on its cores, the ones its imports started
before it bound them (numpy's OpenBLAS pool) too, and torch's team has one thread per core. The
worker is started with exec (a forked one has no import threads: tests/e2e/zygote.py) on its own
Redis, on the small model."""

from __future__ import annotations

import os

import pytest
import redis

from pagedserve.services.common import redis_keys
from tests.e2e.processes import CLUSTER_TOKEN, pagedserve, start_redis, thread_cores, wait_until
from tests.e2e.zygote import EXEC_VARIABLE

pytestmark = pytest.mark.e2e


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs a core to leave out")
def test_a_worker_given_one_core_runs_every_thread_there_and_torch_on_one(tmp_path, small_model):
    redis_process, url = start_redis(tmp_path)
    core = str(max(os.sched_getaffinity(0)))
    env = {**os.environ, "PAGEDSERVE_CLUSTER_TOKEN": CLUSTER_TOKEN, EXEC_VARIABLE: "1"}
    worker = pagedserve("worker", ["worker", "--redis-url", url, "--model", str(small_model), "--host", "127.0.0.1",
                                   "--port", "0", "--kv-cache-memory", "8MiB", "--worker-id", "w", "--cpu-affinity", core],
                        tmp_path, env)
    try:
        client = redis.Redis.from_url(url)
        wait_until(lambda: client.hexists(redis_keys.WORKERS_HASH, "w"), "the worker's registration", 120, [worker])
        assert set(thread_cores(worker.popen.pid)) == {core}
        wait_until(lambda: "KV blocks on 1 threads" in worker.log_text(), "the worker's serving line", 30, [worker])
    finally:
        worker.stop()
        redis_process.stop()
