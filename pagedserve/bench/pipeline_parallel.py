"""`pagedserve bench pipeline-parallel`: offline throughput of one worker split into P pipeline
stages (with V virtual engines) vs one rank, and the pipeline bubble.

For each ``P:V`` a fresh in-process engine (``LLM(pipeline_parallel_size=P, virtual_engines=V)``:
rank 0 here, P-1 helper processes over gloo) runs the same seeded random-token prompts as
``bench tensor-parallel``, greedy with EOS ignored; a short warm-up request runs first and is not
timed. The ranks share this machine's cores (``cores // P`` torch threads each), so on a CPU the
table gives the price of the communication (one ``send``/``recv`` of the hidden states per stage
boundary per plan, the plan piped to every rank, the result piped back), not a speed-up.

Bubble: each rank's busy seconds (time in its runners' ``execute`` minus time blocked in
``send``/``recv``) over the timed run's wall time; ``1 - busy / elapsed`` is the fraction of the
run the stage was idle (Narayanan et al., 2021, §2.2: ``(P-1)/P`` with one plan in flight, less
when virtual engines overlap). The engine's own scheduling time counts as idle for every stage.

``P:V`` runs the prompts through ``LLM.generate``: one scheduler over the V engines (each keeps
up to ``max_plans_in_flight`` plans queued on its thread). ``P:Vi`` gives each virtual engine a
scheduler and a step loop of its own on its own thread, the prompts dealt round-robin, as the
services run them (each worker id its own step pipeline).
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from pathlib import Path

from pagedserve.bench.machine import machine_info, machine_line
from pagedserve.bench.report import format_table
from pagedserve.bench.tensor_parallel import add_run_arguments, random_prompts


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("pipeline-parallel", help="offline throughput with P pipeline stages per worker vs one",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="1:1,2:1,2:2,2:2i",
                   help="comma-separated P:V, pipeline stages and virtual engines; a trailing i: one step "
                   "loop per virtual engine, as in the services (default %(default)s)")
    add_run_arguments(p)
    p.set_defaults(func=main)


def independent_loops(llm, prompts: list[list[int]], params) -> int:
    """Runs ``prompts`` dealt round-robin over ``llm``'s virtual engines, each with a scheduler and
    a step loop of its own on its own thread; returns the number of output tokens."""
    from pagedserve.engine.engine import Engine, LocalExecutor
    from pagedserve.engine.messages import EngineRequest
    from pagedserve.engine.scheduler import Scheduler

    info = llm.tokenizer.info
    engines = []
    for worker_id, runner in llm._runners.items():
        scheduler = Scheduler(llm.engine.scheduler.config)
        scheduler.add_worker(worker_id, runner.num_blocks, runner.num_cpu_blocks, llm.config.runner.device)
        engines.append(Engine(scheduler, LocalExecutor({worker_id: runner})))
    for i, prompt in enumerate(prompts):
        sampling = params.to_engine(len(prompt), info.max_model_len, info.vocab_size, info.eos_token_ids)
        engines[i % len(engines)].add_request(EngineRequest(f"bench-{i}", tuple(prompt), sampling, time.time()))
    counts = [0] * len(engines)

    def loop(index: int) -> None:
        while engines[index].has_unfinished_requests():
            counts[index] += sum(len(out.new_token_ids) for out in engines[index].step())

    threads = [threading.Thread(target=loop, args=(i,), name=f"ve{i}-loop") for i in range(len(engines))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for engine in engines:
        engine.executor.shutdown()
    return sum(counts)


def run_config(model: Path, stages: int, engines: int, prompts: list[list[int]], max_tokens: int,
               kv_memory: str, loops: str = "") -> dict:
    """One engine of ``stages`` stages and ``engines`` virtual engines over ``prompts`` (``loops``
    ``"i"``: one step loop per virtual engine): elapsed seconds, output tokens/s and each rank's
    idle fraction (``None`` for one rank)."""
    import torch

    from pagedserve.engine.sampling_params import SamplingParams
    from pagedserve.llm import LLM

    threads = max(1, (os.cpu_count() or 1) // stages)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    try:
        with LLM(model, kv_cache_memory=kv_memory, pipeline_parallel_size=stages, virtual_engines=engines) as llm:
            llm.generate([prompts[0][:8]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
            pipeline = getattr(next(iter(llm._runners.values())), "pipeline", None)
            before = pipeline.stage_busy_seconds() if pipeline else None
            start = time.perf_counter()
            if loops:
                tokens = independent_loops(llm, prompts, params)
            else:
                tokens = sum(len(o.token_ids) for o in llm.generate(prompts, params))
            elapsed = time.perf_counter() - start
            after = pipeline.stage_busy_seconds() if pipeline else None
    finally:
        torch.set_num_threads(previous)
    idle = None if pipeline is None else [1 - (b - a) / elapsed for a, b in zip(before, after)]
    return {"pipeline_parallel_size": stages, "virtual_engines": engines, "step_loops": "per engine" if loops else "one",
            "threads_per_rank": threads,
            "elapsed_s": elapsed, "output_tokens": tokens, "output_tokens_per_s": tokens / elapsed,
            "idle_fraction_per_rank": idle, "bubble": None if idle is None else sum(idle) / len(idle)}


def main(args: argparse.Namespace) -> int:
    from pagedserve.engine.models.registry import load_model_config
    from pagedserve.model_files import resolve_model

    model = resolve_model(args.model or None)
    prompts = random_prompts(load_model_config(model).vocab_size, args.num_prompts)
    configs = [c.split(":") for c in args.configs.split(",")]
    runs = [run_config(model, int(p), int(v.rstrip("i")), prompts, args.max_tokens, args.kv_cache_memory,
                       v[len(v.rstrip("i")):]) for p, v in configs]
    base = runs[0]["output_tokens_per_s"]
    info = machine_info()
    rows = [[r["pipeline_parallel_size"], r["virtual_engines"], r["step_loops"], r["threads_per_rank"], r["elapsed_s"],
             r["output_tokens_per_s"], r["output_tokens_per_s"] / base, r["bubble"],
             None if r["idle_fraction_per_rank"] is None else " ".join(f"{x:.2f}" for x in r["idle_fraction_per_rank"])]
            for r in runs]
    print(format_table(["PP", "VE", "step loops", "threads/rank", "elapsed s", "output tok/s", "vs first", "bubble",
                        "idle per stage"], rows,
                       title=f"Pipeline parallel, {model.name}, {len(prompts)} prompts x {args.max_tokens} tokens "
                       f"({machine_line(info)})"))
    if args.result_json:
        args.result_json.write_text(json.dumps({"machine": info, "model": str(model), "runs": runs}, indent=2))
    return 0
