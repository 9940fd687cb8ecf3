"""`pagedserve bench overhead`: what the service split costs, measured in one run.

1. The same workload (all requests at once) through the whole stack (gateway, Redis, scheduler,
   one worker, over gRPC) and through the in-process engine with the same settings, the services'
   scheduling policy included (the offline engine's own defaults fill every prefill chunk: a policy
   difference, not a price of the split): the ratio of output tokens/s.
2. TTFT of a single request through the stack and in-process (median of ``--ttft-repeats``
   prompts, each unique so that no prefix-cache hit shortens it).
The two sides take turns, request by request for TTFT and pass by pass (``--rounds``) for
throughput, so that a slow spell of a shared machine falls on both alike.
With ``--max-plans-in-flight 1,2`` both sides run once per value (a stack each), in the same
turns: what overlap scheduling gives in-process and through the stack.
3. The scheduler's own time per iteration (schedule + apply results, plus the protobuf encoding
   of plans and results that the service adds) at 32, 128 and 256 running decode sequences, with
   an instant stand-in for the model so that the model step is excluded.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from pagedserve.config_flags import add_config_arguments, fields_except
from pagedserve.engine.runner_config import KERNELS, RunnerConfig, kernel_options
from pagedserve.bench.datasets import SampleRequest, add_dataset_arguments, dataset_spec_from_args, sample_requests
from pagedserve.bench.in_process import ttft_ms
from pagedserve.bench.machine import machine_info, machine_line
from pagedserve.bench.scheduler_cost import scheduler_iteration_ms
from pagedserve.engine.config import SchedulerConfig


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("overhead", help="the price of the service split: stack vs in-process engine",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="", help="model folder (default: the default model)")
    add_dataset_arguments(p)
    p.add_argument("--kv-cache-memory", default="2GiB", help="KV-cache memory of the worker (default %(default)s)")
    add_config_arguments(p, RunnerConfig, exclude=fields_except(RunnerConfig, KERNELS))
    p.add_argument("--threads-per-worker", type=int, default=0,
                   help="model threads on both sides, pinned to the first cores (default: every core); fewer "
                        "than the cores leaves the rest to the gateway, scheduler, Redis and this client")
    p.add_argument("--ttft-repeats", type=int, default=10, help="single-request TTFT samples (default %(default)s)")
    p.add_argument("--rounds", type=int, default=2,
                   help="throughput passes per side, taken in turns (default %(default)s)")
    p.add_argument("--running", default="32,128,256",
                   help="running-sequence counts for the scheduler timing (default %(default)s)")
    p.add_argument("--iterations", type=int, default=200, help="scheduler iterations timed per count")
    p.add_argument("--max-plans-in-flight", default="2",
                   help="comma-separated values to compare (1: no overlap scheduling; 2: overlap) (default %(default)s)")
    p.add_argument("--result-json", type=Path, help="write every figure here")
    p.set_defaults(func=run)


class _InProcess:
    """The in-process engine, on the cores the stack's worker gets."""

    def __init__(self, model: Path, args: argparse.Namespace, policy: SchedulerConfig) -> None:
        import torch

        from pagedserve.llm import LLM

        self.cores = range(_threads(args))
        torch.set_num_threads(len(self.cores))
        # the stack's policy, not the offline engine's defaults (full prefill chunks: llm.offline_config)
        self.llm = LLM(model, kv_cache_memory=args.kv_cache_memory, **kernel_options(args),
                       **{f.name: getattr(policy, f.name) for f in dataclasses.fields(policy)})

    @contextlib.contextmanager
    def _on_worker_cores(self):
        """Runs the model on this thread on the cores the stack's worker has, as long as it steps."""
        before = os.sched_getaffinity(0)
        os.sched_setaffinity(0, self.cores)
        try:
            yield
        finally:
            os.sched_setaffinity(0, before)

    def ttft_ms(self, prompt: str) -> float:
        """Time to the first token of ``prompt`` sent alone (ms)."""
        with self._on_worker_cores():
            return ttft_ms(self.llm, prompt)

    def run(self, requests: list[SampleRequest]) -> tuple[int, float]:
        """All ``requests`` at once; returns (output tokens, seconds)."""
        from pagedserve.engine.sampling_params import SamplingParams

        with self._on_worker_cores():
            start = time.perf_counter()
            for r in requests:
                self.llm.add_request(r.prompt, SamplingParams(max_tokens=r.expected_output_len, temperature=0.0,
                                                              ignore_eos=True))
            while self.llm.has_unfinished_requests():
                self.llm.step()
            return sum(r.expected_output_len for r in requests), time.perf_counter() - start


class _ThroughStack:
    """The same two measurements through a running gateway."""

    def __init__(self, target: str) -> None:
        self.target = target

    def ttft_ms(self, prompt: str) -> float:
        records, _ = self._load([SampleRequest(prompt, 0, 1)], timeout_s=600)
        return records[0].ttft_s * 1000

    def run(self, requests: list[SampleRequest]) -> tuple[int, float]:
        records, duration = self._load(requests, timeout_s=3600)
        failed = [r for r in records if r.error]
        if failed:
            raise RuntimeError(f"{len(failed)} requests failed through the stack: {failed[0].error}")
        return sum(r.output_tokens for r in records), duration

    def _load(self, requests: list[SampleRequest], timeout_s: float):
        import asyncio

        from pagedserve.bench.serve import LoadSettings, run_load

        return asyncio.run(run_load(self.target, requests, LoadSettings(float("inf")), temperature=0.0,
                                    ignore_eos=True, timeout_s=timeout_s))


def _measure(sides: dict, requests: list[SampleRequest], args: argparse.Namespace) -> dict:
    """Alternates the sides so that a slow spell of a shared machine hits both alike.

    TTFT prompts are the workload's prompts, each made unique by a numbered first line so that no
    prefix-cache hit shortens them; the first of them warms both sides up and is not counted. Each
    throughput pass's prompts start with a line of their own too: no pass reads another's prefill
    from the cache (both sides' second passes did).
    """
    ttfts: dict[str, list[float]] = {name: [] for name in sides}
    for i in range(args.ttft_repeats + 1):
        prompt = f"Request {i}.\n{requests[i % len(requests)].prompt}"
        for name, side in sides.items():
            ttfts[name].append(side.ttft_ms(prompt))
    totals = {name: [0, 0.0] for name in sides}
    for round_index in range(args.rounds):
        fresh = with_first_line(requests, f"Pass {round_index}.")
        for name, side in sides.items():
            tokens, seconds = side.run(fresh)
            totals[name][0] += tokens
            totals[name][1] += seconds
    return {name: (totals[name][0] / totals[name][1], ttfts[name][1:]) for name in sides}


def with_first_line(requests: list[SampleRequest], line: str) -> list[SampleRequest]:
    """``requests`` with ``line`` before each prompt: a set no earlier pass left in the prefix cache."""
    return [dataclasses.replace(r, prompt=f"{line}\n{r.prompt}") for r in requests]


def _measure_all(model: Path, requests: list[SampleRequest], args: argparse.Namespace,
                 plans_in_flight: list[int]) -> dict:
    """Starts a stack (Redis, scheduler, one worker, gateway) and an in-process engine per value of
    ``plans_in_flight``, both with the services' scheduling policy on this device; measures them all in
    turns. Sides are named ``stack/N`` and ``engine/N``."""
    from pagedserve.launcher import Stack, free_port
    from pagedserve.stack_config import StackConfig

    stacks, sides = [], {}
    with tempfile.TemporaryDirectory() as data_dir:
        try:
            for n in plans_in_flight:
                ports = [free_port() for _ in range(4)]
                runner = RunnerConfig(kv_cache_memory=args.kv_cache_memory, **kernel_options(args))
                policy = SchedulerConfig(max_plans_in_flight=n)  # each side's worker: its device's token budget
                stack = Stack(StackConfig(
                    model=model, workers=1, host="127.0.0.1", port=ports[0], scheduler_port=ports[1],
                    redis_url=f"redis://127.0.0.1:{ports[2]}/0", runner=runner,
                    policy=policy, threads_per_worker=_threads(args),
                    data_dir=Path(data_dir) / str(n), http_port=ports[3], metrics_port=0,
                ))
                stacks.append(stack)
                stack.start()
                sides[f"stack/{n}"] = _ThroughStack(f"127.0.0.1:{ports[0]}")
                sides[f"engine/{n}"] = _InProcess(model, args, policy)
            return _measure(sides, requests, args)
        finally:
            for stack in stacks:
                stack.stop()


def _threads(args: argparse.Namespace) -> int:
    from pagedserve.stack_config import default_threads_per_worker

    cores = os.cpu_count() or 1
    if args.threads_per_worker > cores:
        raise SystemExit(f"--threads-per-worker {args.threads_per_worker} is more than this machine's {cores} cores")
    return args.threads_per_worker or default_threads_per_worker(1)


def run(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from pagedserve.model_files import resolve_model

    model = resolve_model(args.model or None)
    tokenizer = AutoTokenizer.from_pretrained(model)
    requests = sample_requests(dataset_spec_from_args(args), tokenizer)
    print(f"{len(requests)} requests; the stack and the in-process engine take turns", flush=True)
    plans_in_flight = [int(n) for n in args.max_plans_in_flight.split(",")]
    measured = _measure_all(model, requests, args, plans_in_flight)
    costs = [scheduler_iteration_ms(int(n), args.iterations) for n in args.running.split(",")]
    by_plans = {}
    for n in plans_in_flight:
        (stack_tps, stack_ttft), (engine_tps, engine_ttft) = measured[f"stack/{n}"], measured[f"engine/{n}"]
        by_plans[str(n)] = {
            "stack_to_engine_throughput_ratio": stack_tps / engine_tps,
            # paired: the prompts differ in length, so compare each prompt's two TTFTs
            "ttft_added_ms": statistics.median(s - e for s, e in zip(stack_ttft, engine_ttft)),
            "stack_output_tokens_per_s": stack_tps,
            "engine_output_tokens_per_s": engine_tps,
            "stack_ttft_ms": stack_ttft,
            "engine_ttft_ms": engine_ttft,
        }
    result = {
        "by_max_plans_in_flight": by_plans,
        "scheduler_ms_per_iteration": {str(c.num_running): c.median_ms for c in costs},
        "model_threads": _threads(args),
        "scheduler_cost": [c.__dict__ for c in costs],
        "settings": {k: str(v) for k, v in vars(args).items() if k != "func"},
        "machine": machine_info(),
    }
    _print(result, costs)
    if args.result_json:
        args.result_json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


def _print(result: dict, costs) -> None:
    print(f"\nThe price of the service split ({machine_line(result['machine'])}; "
          f"{result['model_threads']} model thread(s) on each side)")
    print(f"{'plans in flight':<16} {'':<28} {'stack':>10} {'in-process':>11}  {'stack vs in-process':>19}")
    for n, r in result["by_max_plans_in_flight"].items():
        print(f"{n:<16} {'output tokens/s':<28} {r['stack_output_tokens_per_s']:>10.1f} "
              f"{r['engine_output_tokens_per_s']:>11.1f}  {'x' + format(r['stack_to_engine_throughput_ratio'], '.3f'):>19}")
        stack_ttft, engine_ttft = statistics.median(r["stack_ttft_ms"]), statistics.median(r["engine_ttft_ms"])
        print(f"{'':<16} {'TTFT, one request (ms, med)':<28} {stack_ttft:>10.1f} {engine_ttft:>11.1f}  "
              f"{format(r['ttft_added_ms'], '+.1f') + ' ms':>19}")
    print("(the TTFT difference is the median of each prompt's own difference)")
    plans = list(result["by_max_plans_in_flight"].values())
    if len(plans) > 1:
        for side in ("stack", "engine"):
            first, last = plans[0][f"{side}_output_tokens_per_s"], plans[-1][f"{side}_output_tokens_per_s"]
            print(f"{side}: last value vs first: x{last / first:.3f} output tokens/s")
    print(f"\n{'running sequences':<18} {'median ms':>10} {'p99 ms':>8} {'median ms +proto':>17} {'p99 ms +proto':>14}")
    for c in costs:
        print(f"{c.num_running:<18} {c.median_ms:>10.3f} {c.p99_ms:>8.3f} {c.median_with_proto_ms:>17.3f} "
              f"{c.p99_with_proto_ms:>14.3f}")
