"""Runs `bench peers`' requests through vLLM's offline ``LLM.generate``; started by `bench peers`
with the Python interpreter of a vLLM install (``--vllm-python``), so it imports only vLLM and the
standard library, never pagedserve.

Usage: ``python vllm_driver.py REQUESTS.json RESULT.json``

REQUESTS.json: ``{"model": folder, "dtype": "float32", "max_num_seqs": int,
"max_num_batched_tokens": int, "max_model_len": int, "kv_cache_gib": int,
"warmup_token_ids": [int], "warmup_tokens": int,
"requests": [{"prompt_token_ids": [int], "max_tokens": int}]}``

RESULT.json: ``{"elapsed_s": seconds of the timed ``generate`` call, "vllm_version": str,
"outputs": [[generated token ids] per request, in request order]}``

Every request is greedy (temperature 0) with EOS ignored, so it generates exactly ``max_tokens``.
One warm-up request runs first, untimed.
"""

import json
import os
import sys
import time


def set_cpu_environment(kv_cache_gib: int) -> None:
    """vLLM CPU's settings, each only where the caller has not set it: KV-cache space (GiB), OpenMP
    threads bound to cores 0-1, loopback host address, no hub access."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


def generate(spec: dict) -> dict:
    """Warms vLLM up with one request, then times one ``generate`` call over all requests."""
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=spec["model"], dtype=spec["dtype"], max_num_seqs=spec["max_num_seqs"],
              max_num_batched_tokens=spec["max_num_batched_tokens"], max_model_len=spec["max_model_len"],
              seed=0)
    llm.generate([TokensPrompt(prompt_token_ids=spec["warmup_token_ids"])],
                 SamplingParams(temperature=0.0, max_tokens=spec["warmup_tokens"], ignore_eos=True), use_tqdm=False)
    prompts = [TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in spec["requests"]]
    params = [SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True) for r in spec["requests"]]
    start = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    return {"elapsed_s": elapsed, "vllm_version": vllm.__version__,
            "outputs": [list(r.outputs[0].token_ids) for r in results]}


def main(argv: list) -> int:
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[1]) as f:
        spec = json.load(f)
    set_cpu_environment(spec["kv_cache_gib"])
    result = generate(spec)
    with open(argv[2], "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
