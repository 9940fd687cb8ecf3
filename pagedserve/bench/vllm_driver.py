"""Runs the benchmarks' requests through vLLM's offline ``LLM.generate``; started by `bench peers`
and `bench structured-outputs` with the Python interpreter of a vLLM install (``--vllm-python``),
so it imports only vLLM and the standard library, never pagedserve.

Usage: ``python vllm_driver.py REQUESTS.json RESULT.json``

REQUESTS.json: ``{"model": folder, "dtype": "float32", "kv_cache_dtype": "auto", "max_num_seqs": int,
"max_num_batched_tokens": int, "max_model_len": int, "kv_cache_gib": int,
"warmup_token_ids": [int], "warmup_tokens": int,
"requests": [{"prompt_token_ids": [int], "max_tokens": int}],
"passes": [null or {StructuredOutputsParams fields, e.g. "json": schema}],
"structured_outputs_config": {StructuredOutputsConfig fields}, "engine_core": "separate_process" or
"in_process"}``; ``engine_core`` (default ``separate_process``, vLLM's own default): where vLLM's engine
core runs; ``in_process`` sets ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (on 2 cores vLLM ran the 64 ShareGPT
requests in 119-126 s so, 138-142 s in its default mode: docs/benchmarks.md); ``passes`` (default ``[null]``,
one free pass): each pass runs every request, free (``null``) or all constrained by that structure,
and is timed on its own; ``structured_outputs_config`` (default ``{}``): the engine's settings for
structured outputs, e.g. ``{"backend": "xgrammar", "disable_any_whitespace": true}`` (vLLM 0.32
reads ``disable_any_whitespace`` there, not from a request's ``StructuredOutputsParams``).

RESULT.json: ``{"vllm_version": str, "structured_outputs_backend": the backend that served the
constrained passes (``null`` when none ran), "passes": [{"elapsed_s": seconds of its ``generate``
call, "outputs": [[generated token ids] per request, in request order]}, in pass order]}``

Every request is greedy (temperature 0) with EOS ignored, so it generates exactly ``max_tokens``.
One warm-up request per distinct structure (and one free) runs first, untimed, so that no grammar
compiles in a timed pass.
"""

import json
import os
import sys
import time


ENGINE_CORES = ("separate_process", "in_process")
"""Where vLLM's engine core runs: its own process (vLLM's default, the first) or the driver's."""
DEFAULT_ENGINE_CORE = ENGINE_CORES[0]


def set_cpu_environment(kv_cache_gib: int, engine_core: str = DEFAULT_ENGINE_CORE) -> None:
    """vLLM CPU's settings, each only where the caller has not set it: KV-cache space (GiB), OpenMP
    threads bound to cores 0-1, loopback host address, no hub access; and the engine core's process
    (one of :data:`ENGINE_CORES`; ValueError otherwise)."""
    if engine_core not in ENGINE_CORES:
        raise ValueError(f"engine_core must be one of {ENGINE_CORES}, got {engine_core!r}")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if engine_core == DEFAULT_ENGINE_CORE else "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


def distinct(structures: list) -> list:
    """``structures`` (JSON values) without repeats, first occurrence first."""
    seen, out = set(), []
    for s in structures:
        key = json.dumps(s, sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append(s)
    return out


def sampling_params(max_tokens: int, structure: dict | None):
    """Greedy, EOS ignored, ``max_tokens`` tokens, constrained by ``structure`` (the fields of
    ``StructuredOutputsParams``) unless it is None."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    constraint = None if structure is None else StructuredOutputsParams(**structure)
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, structured_outputs=constraint)


def generate(spec: dict) -> dict:
    """Warms vLLM up (one request per distinct structure), then times one ``generate`` call over
    all requests per pass."""
    import vllm
    from vllm import LLM
    from vllm.inputs import TokensPrompt

    passes = spec.get("passes", [None])
    llm = LLM(model=spec["model"], dtype=spec["dtype"], max_num_seqs=spec["max_num_seqs"],
              max_num_batched_tokens=spec["max_num_batched_tokens"], max_model_len=spec["max_model_len"],
              kv_cache_dtype=spec.get("kv_cache_dtype", "auto"),
              structured_outputs_config=spec.get("structured_outputs_config", {}), seed=0)
    warmup = [TokensPrompt(prompt_token_ids=spec["warmup_token_ids"])]
    backend = None
    for structure in distinct([None, *passes]):
        params = sampling_params(spec["warmup_tokens"], structure)
        llm.generate(warmup, params, use_tqdm=False)
        if structure is not None:
            backend = params.structured_outputs._backend  # set by vLLM's request validation
    prompts = [TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in spec["requests"]]
    results = []
    for structure in passes:
        params = [sampling_params(r["max_tokens"], structure) for r in spec["requests"]]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=True)
        elapsed = time.perf_counter() - start
        results.append({"elapsed_s": elapsed, "outputs": [list(o.outputs[0].token_ids) for o in outputs]})
    return {"vllm_version": vllm.__version__, "structured_outputs_backend": backend, "passes": results}


def main(argv: list) -> int:
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[1]) as f:
        spec = json.load(f)
    set_cpu_environment(spec["kv_cache_gib"], spec.get("engine_core", DEFAULT_ENGINE_CORE))
    result = generate(spec)
    with open(argv[2], "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
