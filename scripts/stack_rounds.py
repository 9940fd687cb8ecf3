"""Where a stack's time and CPU go while it serves a burst: per round of ShareGPT requests sent at once
through a fresh `pagedserve up`-like stack (one worker), the output tokens/s, the worker's steps and the
share of the wall clock it spent in them, and the CPU seconds of each process (Redis, scheduler, worker,
gateway, and this script's gRPC client). Each round's prompts start with their own line, so no round hits
the prefix cache of another.

    PYTHONPATH=. python scripts/stack_rounds.py --rounds 2 \
        --policy '{"max_decode_slowdown": Infinity, "short_prompt_share": 0}'

``--policy``: ``SchedulerConfig`` fields as JSON, over the stack's own policy (``StackConfig.policy``: the
worker's device's token budget, 256 on a CPU; prefill chunks paced beside decodes; a short-prompt share). The in-process engine's
rounds for comparison: ``--in-process`` (the same policy, the same cores).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import tempfile
import time
import urllib.request
from pathlib import Path

from transformers import AutoTokenizer

from pagedserve.bench.datasets import SampleRequest, add_dataset_arguments, dataset_spec_from_args, sample_requests
from pagedserve.bench.overhead import _InProcess, with_first_line
from pagedserve.bench.serve import LoadSettings, run_load
from pagedserve.engine.runner_config import RunnerConfig
from pagedserve.launcher import Stack, free_port
from pagedserve.model_files import resolve_model
from pagedserve.stack_config import StackConfig

DATA = "../shared/data/sharegpt/sharegpt_v3_random1000_multiturn.json"


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (/proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def context_switches(pid: int) -> int:
    """Times the threads of a process were switched off a CPU so far (voluntary and not; /proc)."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/status") as f:
                total += sum(int(line.split()[1]) for line in f if "ctxt_switches" in line)
        except FileNotFoundError:
            pass  # the thread ended
    return total


def scrape(port: int, names: tuple[str, ...]) -> dict[str, float]:
    """The named series of a Prometheus /metrics page, summed over their labels."""
    out = dict.fromkeys(names, 0.0)
    for line in urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode().splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in out:
            out[name] += float(line.rsplit(" ", 1)[1])
    return out


def stack_rounds(model: Path, requests: list[SampleRequest], config: StackConfig, rounds: int) -> None:
    steps = ("pagedserve_worker_step_seconds_count", "pagedserve_worker_step_seconds_sum")
    stack = Stack(config)
    stack.start()
    try:
        target = f"127.0.0.1:{config.port}"
        asyncio.run(run_load(target, requests[:4], LoadSettings(float("inf")), temperature=0.0, ignore_eos=True,
                             timeout_s=600))  # warm-up
        pids = {p.pid: name for name, p in stack.children} | {os.getpid(): "client (this script)"}
        for i in range(rounds):
            before, metrics = {pid: cpu_seconds(pid) for pid in pids}, scrape(config.metrics_port + 2, steps)
            switches = {pid: context_switches(pid) for pid in pids}
            start = time.perf_counter()
            fresh = with_first_line(requests, f"Round {i}.")
            records, _ = asyncio.run(run_load(target, fresh, LoadSettings(float("inf")), temperature=0.0,
                                              ignore_eos=True, timeout_s=3600))
            wall = time.perf_counter() - start
            after = scrape(config.metrics_port + 2, steps)
            num_steps, busy = (after[n] - metrics[n] for n in steps)
            tokens = sum(r.output_tokens for r in records)
            print(f"stack round {i}: {tokens / wall:.1f} output tok/s ({wall:.2f} s), {num_steps:.0f} worker steps, "
                  f"in steps {busy / wall:.0%} of the time", flush=True)
            for pid, name in pids.items():
                print(f"    {name:22s} {cpu_seconds(pid) - before[pid]:6.2f} CPU-s, "
                      f"{context_switches(pid) - switches[pid]:7d} context switches")
    finally:
        stack.stop()


def in_process_rounds(model: Path, requests: list[SampleRequest], config: StackConfig, rounds: int) -> None:
    flags = argparse.Namespace(kv_cache_memory=config.runner.kv_cache_memory, threads_per_worker=0,
                               gemm_backend=config.runner.gemm_backend, compile_mode=config.runner.compile_mode,
                               kv_cache_dtype=config.runner.kv_cache_dtype)
    side = _InProcess(model, flags, config.policy)
    side.run(requests[:4])  # warm-up
    for i in range(rounds):
        steps = side.llm.stats().num_steps
        tokens, seconds = side.run(with_first_line(requests, f"Round {i}."))
        print(f"in-process round {i}: {tokens / seconds:.1f} output tok/s ({seconds:.2f} s), "
              f"{side.llm.stats().num_steps - steps} steps", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_dataset_arguments(parser)
    parser.set_defaults(dataset_name="sharegpt", dataset_path=DATA, num_prompts=32, output_len=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--policy", default="{}", help="SchedulerConfig fields as JSON (default: the stack's own)")
    parser.add_argument("--in-process", action="store_true", help="the in-process engine's rounds instead")
    args = parser.parse_args()
    model = resolve_model(None)
    requests = sample_requests(dataset_spec_from_args(args), AutoTokenizer.from_pretrained(model))
    base = StackConfig(model=model)
    with tempfile.TemporaryDirectory() as data_dir:
        ports = [free_port() for _ in range(4)]
        metrics = free_port()  # the gateway's; the scheduler's and the worker's follow it
        config = dataclasses.replace(
            base, workers=1, host="127.0.0.1", port=ports[0], scheduler_port=ports[1], http_port=ports[3],
            redis_url=f"redis://127.0.0.1:{ports[2]}/0", metrics_port=metrics, data_dir=Path(data_dir),
            runner=RunnerConfig(kv_cache_memory="2GiB"),
            policy=dataclasses.replace(base.policy, **json.loads(args.policy)))
        print(f"{len(requests)} requests a round; policy {config.policy}", flush=True)
        (in_process_rounds if args.in_process else stack_rounds)(model, requests, config, args.rounds)


if __name__ == "__main__":
    main()
