"""`pagedserve bench serve`: latency and throughput of a running gateway under a request load.

Streams ``Generation.Generate`` calls over ``grpc.aio``, or (``--backend openai``) streamed
``/v1/completions`` requests over HTTP (``load_senders``), one coroutine per request so that hundreds
of concurrent streams are cheap; timestamps every response that carries tokens, and reports the
metrics of ``pagedserve.bench.metrics`` (vLLM's serving-benchmark definitions).

Arrivals follow vLLM: all at once for rate ``inf``; otherwise gamma-distributed gaps with shape
``burstiness`` and mean ``1 / rate`` s (burstiness 1 is a Poisson process). ``--max-concurrency``
caps the calls in flight; a request's send time is taken once it holds a slot.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

from pagedserve.bench.datasets import SampleRequest, add_dataset_arguments
from pagedserve.bench.load_senders import Backend, SendSettings, sender
from pagedserve.bench.metrics import RequestRecord, ServeMetrics, compute_metrics, error_counts
from pagedserve.bench.serve_compare import format_backend_comparison, parse_backends
from pagedserve.units import positive
from pagedserve.services.common.service_args import DEFAULT_HTTP_PORT, DEFAULT_TARGET, grpc_target


@dataclass(frozen=True)
class LoadSettings:
    """How one run offers load: rate (req/s, ``inf`` = all at once), burstiness (gamma shape),
    max_concurrency (calls in flight, ``None`` = no cap), seed (arrival times)."""

    request_rate: float
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0


@dataclass(frozen=True)
class RunResult:
    """One run: its load, its figures, failures by status name, every request's record, the API it drove."""

    load: LoadSettings
    metrics: ServeMetrics
    errors: dict[str, int]
    records: tuple[RequestRecord, ...]
    backend: Backend = Backend.GRPC


def parse_rates(text: str) -> tuple[float, ...]:
    """``"1,2,inf"`` -> ``(1.0, 2.0, inf)`` (req/s). Raises ``argparse.ArgumentTypeError`` on a bad value."""
    try:
        rates = tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a list of rates: {text!r}") from exc
    if not rates or any(not r > 0 for r in rates):
        raise argparse.ArgumentTypeError(f"rates must be positive numbers or inf, got {text!r}")
    return rates


def arrival_offsets(n: int, load: LoadSettings) -> list[float]:
    """When each of ``n`` requests is due, s after the start: the first at 0, then gamma gaps.

    The gaps have shape ``burstiness`` and scale ``1 / (rate * burstiness)``, so their mean is ``1 / rate``.
    """
    import numpy as np

    if math.isinf(load.request_rate) or n <= 1:
        return [0.0] * n
    rng = np.random.default_rng(load.seed)
    gaps = rng.gamma(shape=load.burstiness, scale=1.0 / (load.request_rate * load.burstiness), size=n - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


async def run_load(target: str, samples: Sequence[SampleRequest], load: LoadSettings, *, temperature: float,
                   ignore_eos: bool, timeout_s: float, progress=None, connect_timeout_s: float = 10.0,
                   api_key: str = "", backend: Backend = Backend.GRPC,
                   model_name: str = "") -> tuple[list[RequestRecord], float]:
    """Sends ``samples`` to the server at ``target`` as ``load`` says, over ``backend``'s API.

    Args:
        target: the gateway's gRPC HOST:PORT, or its HTTP base URL for ``Backend.OPENAI``.
        model_name: the served model name (the OpenAI API's ``model``).

    Returns:
        The records in sample order, and the duration (s) from the first send to the last reply.

    Raises:
        ConnectionError: the server did not answer within ``connect_timeout_s``.
    """
    settings = SendSettings(temperature, ignore_eos, timeout_s, api_key, model_name, connect_timeout_s)
    offsets = arrival_offsets(len(samples), load)
    semaphore = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None
    async with sender(backend, target, settings) as send:

        async def limited(sample: SampleRequest, start: float) -> RequestRecord:
            async with semaphore or nullcontext():
                record = await send(sample, start)
            if progress is not None:
                progress.update(1)
            return record

        start = time.perf_counter()
        tasks = []
        for sample, due in zip(samples, offsets):
            delay = start + due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(limited(sample, start)))
        records = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return list(records), duration


def format_run(result: RunResult) -> str:
    """The run's figures as a one-column table (as vLLM's "Serving Benchmark Result")."""
    from pagedserve.bench.report import format_key_values

    m, load = result.metrics, result.load
    sections = [(None, [
        ("Request rate (req/s)", "inf" if math.isinf(load.request_rate) else load.request_rate),
        ("Burstiness", load.burstiness),
        ("Max concurrency", load.max_concurrency or "none"),
        ("Completed requests", m.completed),
        ("Failed requests", m.failed),
        ("Benchmark duration (s)", m.duration_s),
        ("Total input tokens", m.total_input_tokens),
        ("Total output tokens", m.total_output_tokens),
        ("Request throughput (req/s)", m.request_throughput),
        ("Output token throughput (tok/s)", m.output_throughput),
        ("Total token throughput (tok/s)", m.total_token_throughput),
    ])]
    for key, heading in (("ttft", "Time to first token"), ("tpot", "Time per output token (after the 1st)"),
                         ("itl", "Inter-token latency"), ("e2el", "End-to-end latency")):
        stats = getattr(m, key)
        name = key.upper()
        sections.append((heading, [(f"Mean {name} (ms)", stats.mean_ms), (f"Median {name} (ms)", stats.median_ms),
                                   (f"P90 {name} (ms)", stats.p90_ms), (f"P99 {name} (ms)", stats.p99_ms)]))
    if result.errors:
        sections.append(("Failures", sorted(result.errors.items())))
    return format_key_values("Serving Benchmark Result", sections)


def format_rate_rows(results: Sequence[RunResult]) -> str:
    """One row per run: rate, counts, throughputs (req/s, tok/s) and mean/p99 latencies (ms)."""
    from pagedserve.bench.report import format_table

    headers = ["rate (req/s)", "done", "failed", "duration (s)", "req/s", "out tok/s", "mean TTFT", "p99 TTFT",
               "mean TPOT", "p99 TPOT", "mean ITL", "mean E2EL"]
    rows = [["inf" if math.isinf(r.load.request_rate) else f"{r.load.request_rate:g}", r.metrics.completed,
             r.metrics.failed, r.metrics.duration_s, r.metrics.request_throughput, r.metrics.output_throughput,
             r.metrics.ttft.mean_ms, r.metrics.ttft.p99_ms, r.metrics.tpot.mean_ms, r.metrics.tpot.p99_ms,
             r.metrics.itl.mean_ms, r.metrics.e2el.mean_ms] for r in results]
    return format_table(headers, rows, title=" Serving Benchmark by request rate (latencies in ms) ")


def _load_samples(args: argparse.Namespace) -> tuple[Path, list[SampleRequest]]:
    from transformers import AutoTokenizer

    from pagedserve.bench.datasets import dataset_spec_from_args, sample_requests
    from pagedserve.model_files import resolve_model

    model = resolve_model(args.model or None)
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    return model, sample_requests(dataset_spec_from_args(args), tokenizer)


def _settings(args: argparse.Namespace, model: Path, result: RunResult) -> dict:
    load = result.load
    return {"backend": result.backend.value, "target": _target(args, result.backend), "model": str(model), "dataset_name": args.dataset_name,
            "dataset_path": args.dataset_path, "num_prompts": args.num_prompts, "seed": args.seed,
            "input_len": args.input_len, "output_len": args.output_len, "range_ratio": args.range_ratio,
            "request_rate": load.request_rate, "burstiness": load.burstiness,
            "max_concurrency": load.max_concurrency, "temperature": args.temperature,
            "ignore_eos": args.ignore_eos, "timeout_s": args.timeout}


def _target(args: argparse.Namespace, backend: Backend) -> str:
    return args.target if backend is Backend.GRPC else args.base_url


def _run_one(args: argparse.Namespace, samples: list[SampleRequest], load: LoadSettings, backend: Backend) -> RunResult:
    from tqdm import tqdm

    label = "inf" if math.isinf(load.request_rate) else f"{load.request_rate:g}"
    with tqdm(total=len(samples), desc=f"{backend.value} rate {label} req/s", unit="req",
              disable=args.disable_tqdm) as bar:
        records, duration = asyncio.run(run_load(_target(args, backend), samples, load, temperature=args.temperature,
                                                 ignore_eos=args.ignore_eos, timeout_s=args.timeout, progress=bar,
                                                 api_key=args.api_key, backend=backend,
                                                 model_name=args.served_model_name))
    return RunResult(load, compute_metrics(records, duration), error_counts(records), tuple(records), backend)


def run_serve(args: argparse.Namespace) -> int:
    """Runs `pagedserve bench serve`; 0 when every run completed at least one request, else 1 (2: bad input)."""
    from pagedserve.bench.datasets import DatasetError
    from pagedserve.bench.report import write_json

    try:
        model, samples = _load_samples(args)
    except (DatasetError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    args.served_model_name = args.served_model_name or model.name
    results = []
    for rate in args.request_rate:
        load = LoadSettings(rate, args.burstiness, args.max_concurrency, args.seed)
        for backend in [b for _ in range(args.rounds) for b in args.backend]:  # backends take turns
            try:
                results.append(_run_one(args, samples, load, backend))
            except ConnectionError as exc:
                print(f"error: {exc}", file=sys.stderr)
                return 1
            print(format_run(results[-1]), flush=True)
    if len(args.request_rate) > 1:
        print(format_rate_rows(results))
    if len(args.backend) > 1:
        print(format_backend_comparison(results))
    runs = [{"settings": _settings(args, model, r), "metrics": r.metrics, "errors": r.errors,
             "requests": r.records} for r in results]
    if args.result_json:
        from pagedserve.bench.machine import machine_info

        machine = {"machine": machine_info()}  # the client's; the same as the server's when run side by side
        write_json(args.result_json, {**runs[0], **machine} if len(runs) == 1 else {"runs": runs, **machine})
    if args.plot:
        _write_plots(args.plot, results)
    return 0 if all(r.metrics.completed > 0 for r in results) else 1


def _write_plots(out_dir: Path, results: Sequence[RunResult]) -> None:
    from pagedserve.bench.plots import plot_latency_cdfs, plot_throughput_vs_rate

    labels = [f"rate {'inf' if math.isinf(r.load.request_rate) else f'{r.load.request_rate:g}'}" for r in results]
    written = plot_latency_cdfs(list(zip(labels, [r.records for r in results])), out_dir)
    if len(results) > 1:
        written.append(plot_throughput_vs_rate([r.load.request_rate for r in results],
                                               [r.metrics.output_throughput for r in results], out_dir))
    print("plots: " + ", ".join(str(p) for p in written))


def add_parser(sub: "argparse._SubParsersAction") -> None:
    """Adds `pagedserve bench serve`."""
    p = sub.add_parser(
        "serve", help="latency and throughput of a running gateway (TTFT, TPOT, ITL, E2EL)",
        description="Send a prompt set to a running gateway over streaming gRPC (or its OpenAI HTTP API) and report vLLM's serving "
        "metrics: throughput (req/s, tok/s) and mean/median/p90/p99 of TTFT, TPOT, ITL and E2EL (ms).")
    p.add_argument("--backend", type=parse_backends, default=(Backend.GRPC,), metavar="{grpc,openai}[,...]",
                   help="the API to drive: grpc (pagedserve's Generation.Generate) or openai (POST /v1/completions "
                   "with stream: true, as vLLM's serving benchmark: any OpenAI-compatible server); a list such as "
                   "grpc,openai runs each in turn on the same requests and compares them (default: grpc)")
    p.add_argument("--target", default=DEFAULT_TARGET, type=grpc_target,
                   help="gRPC gateway HOST:PORT (default %(default)s)")
    p.add_argument("--base-url", default=f"http://127.0.0.1:{DEFAULT_HTTP_PORT}",
                   help="base URL of the OpenAI-compatible server (default %(default)s)")
    p.add_argument("--rounds", type=positive(int), default=1,
                   help="with several backends: how many times they take turns (default %(default)s)")
    p.add_argument("--served-model-name", default="",
                   help="the `model` sent to the OpenAI API (default: the --model folder's name)")
    p.add_argument("--api-key", default=os.environ.get("PAGEDSERVE_API_KEY", ""),
                   help="the gateway's API key (env PAGEDSERVE_API_KEY)")
    p.add_argument("--model", default="", help="model folder whose tokenizer measures prompt lengths "
                   "(default: the default model, SmolLM2-135M-Instruct)")
    add_dataset_arguments(p)
    load = p.add_argument_group("load")
    load.add_argument("--request-rate", type=parse_rates, default=(math.inf,), metavar="RATES",
                      help="requests per second, or a comma-separated list run in turn, e.g. 1,2,4,inf; "
                      "inf sends everything at once (default inf)")
    load.add_argument("--burstiness", type=positive(float), default=1.0,
                      help="gamma shape of the gaps between arrivals: 1 is Poisson, <1 burstier, >1 steadier "
                      "(default %(default)s)")
    load.add_argument("--max-concurrency", type=positive(int), default=None,
                      help="most calls in flight at once (default: no cap)")
    load.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default %(default)s)")
    load.add_argument("--ignore-eos", action="store_true", help="generate exactly max_tokens (=output length)")
    load.add_argument("--timeout", type=positive(float), default=600.0, help="per-request deadline, s (default %(default)s)")
    out = p.add_argument_group("output")
    out.add_argument("--result-json", type=Path, help="write every figure, the settings and each request's record")
    out.add_argument("--plot", type=Path, metavar="DIR", help="write latency CDFs (and throughput vs rate) as PNGs")
    out.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    p.set_defaults(func=run_serve)
