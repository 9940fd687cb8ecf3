"""Builds a worker's ModelRunner from a Hugging Face folder: weights, GEMM backend, KV cache, compile mode."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from pagedserve.engine.attention import make_attention_backend
from pagedserve.engine.config import DEFAULT_BLOCK_SIZE, CompileMode, GemmBackend, KVCacheDtype
from pagedserve.engine.cpu_features import check_cpu_dtype, cpu_flags
from pagedserve.engine.grammar_matchers import grammar_compiler_for
from pagedserve.engine.kv_cache import KVCacheSpec, cache_dtype, context_shortfall, sized_cache
from pagedserve.engine.model_runner import ModelRunner
from pagedserve.engine.openmp_threads import release_openmp_team
from pagedserve.engine.models.onednn import pack_linear_layers, resolve_gemm_backend
from pagedserve.engine.sampler import Sampler
from pagedserve.engine.runner_config import DEFAULT_KV_CACHE_MEMORY, RunnerConfig
from pagedserve.engine.spec_decode.config import SpeculativeConfig
from pagedserve.engine.spec_decode.draft_model import build_proposer, speculative_caches
from pagedserve.engine.weight_loader import load_model

log = logging.getLogger("pagedserve.worker")


def resolve_dtype(dtype: str, device: str) -> str:
    """``auto`` -> ``bfloat16`` on CUDA, ``float32`` elsewhere; other names unchanged.

    Raises:
        ValueError: ``bfloat16`` on a CPU without native bfloat16 (:func:`check_cpu_dtype`).
    """
    resolved = dtype if dtype != "auto" else "bfloat16" if device.startswith("cuda") else "float32"
    if not device.startswith("cuda"):
        check_cpu_dtype(resolved, cpu_flags())
    return resolved


def build_model_runner(model_path: str | Path, *, kv_cache_memory_bytes: int | None = None,
                       block_size: int = DEFAULT_BLOCK_SIZE,
                       dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                       attention_backend: str = "auto", gemm_backend: GemmBackend | str = GemmBackend.AUTO,
                       compile_mode: CompileMode | str = CompileMode.EAGER,
                       kv_cache_dtype: KVCacheDtype | str = KVCacheDtype.AUTO, gpu_memory_utilization: float = 0.9,
                       swap_space_bytes: int = 0, sampler_seed: int | None = None,
                       speculative: SpeculativeConfig = SpeculativeConfig()) -> ModelRunner:
    """Loads the model of a Hugging Face folder and sizes a KV cache; the calling thread's OpenMP
    team is released at the end (``openmp_threads.release_openmp_team``), as the runner runs elsewhere.

    Args:
        model_path: folder with ``config.json`` and ``*.safetensors``.
        kv_cache_memory_bytes: bytes for K and V of all layers together (a draft model's cache
            included: both have the same number of blocks). ``None``: on CUDA, what
            ``gpu_memory_utilization`` leaves after the weights; elsewhere 1 GiB.
        block_size: token slots per block.
        dtype: weights and activations dtype.
        device: where everything lives.
        attention_backend: ``auto`` (Triton on CUDA, the C++ op elsewhere), ``cpu``, ``torch`` or ``triton``.
        gemm_backend: ``auto`` (``models/onednn.resolve_gemm_backend``), ``torch`` (``F.linear``,
            transformers' kernels: the reference path), ``onednn`` (prepacked oneDNN GEMMs on CPU, 2-3x
            faster, float32 sums in another order) or ``panels`` (float32 layers on pagedserve's GEMM).
        compile_mode: ``eager``, or ``inductor`` (the dense part compiled with ``torch.compile``;
            compiles during this call, tens of seconds; opt-in, see ``models/compiled.py``).
        kv_cache_dtype: what the cache stores: ``auto`` (``dtype``), ``bfloat16`` or ``fp8_e5m2``
            (``kv_cache.cache_dtype``); blocks are counted from its element size.
        gpu_memory_utilization: fraction of the GPU's memory this worker may use in all.
        swap_space_bytes: CPU memory for swapped-out blocks (swap preemption); 0: none.
        sampler_seed: seed of the generator for requests without their own seed.
        speculative: speculative decoding (the worker's proposer; a draft model is loaded here).

    Raises:
        ValueError: the budget holds no block, an unknown backend or cache dtype, a cache dtype this
            torch lacks, oneDNN GEMMs off the CPU, or a draft model of another vocabulary size (and
            the loader's errors).
    """
    kv_dtype = cache_dtype(kv_cache_dtype, dtype)  # before loading: a refusal costs nothing
    backend = make_attention_backend(attention_backend, device)
    model = load_model(model_path, dtype=dtype, device=device)
    gemm = resolve_gemm_backend(gemm_backend, device)
    if gemm is not GemmBackend.TORCH:
        pack_linear_layers(model, gemm)
        if CompileMode(compile_mode) is CompileMode.EAGER:  # a compiled forward traces the Python layers
            model.use_decode_layers()
    config = model.config
    spec = KVCacheSpec(config.num_layers, config.num_kv_heads, config.head_dim, block_size, kv_dtype)
    if kv_cache_memory_bytes is None:
        kv_cache_memory_bytes = _default_kv_memory(torch.device(device), gpu_memory_utilization)
    beside = speculative_caches(speculative, spec)
    kv_cache = sized_cache(spec, kv_cache_memory_bytes, swap_space_bytes, device, *beside)
    if (shortfall := context_shortfall(spec, kv_cache.num_blocks, config.max_model_len, *beside)) is not None:
        log.warning(shortfall)
    proposer = build_proposer(speculative, model, gemm, kv_cache, backend)
    forward = None
    if CompileMode(compile_mode) is CompileMode.INDUCTOR:
        from pagedserve.engine.models.compiled import CompiledForward

        forward = CompiledForward(model)
    runner = ModelRunner(model, kv_cache, backend, Sampler(seed=sampler_seed, device=device), forward,
                         grammar_compiler_for(model_path), proposer)
    if forward is not None:
        runner.warm_up()
    release_openmp_team()  # the runner runs on another thread: one OpenMP team per process (openmp_threads.py)
    return runner


def build_configured_runner(model_path: str | Path, runner: RunnerConfig, block_size: int,
                            speculative: SpeculativeConfig = SpeculativeConfig()) -> ModelRunner:
    """:func:`build_model_runner` with every setting of a one-rank worker's ``runner`` config: the one
    place that maps RunnerConfig's fields onto the runner (the offline engine's workers and the
    worker service both build theirs here). Raises what :func:`build_model_runner` raises."""
    return build_model_runner(
        model_path, kv_cache_memory_bytes=runner.kv_cache_memory, block_size=block_size,
        dtype=getattr(torch, resolve_dtype(runner.dtype, runner.device)), device=runner.device,
        attention_backend=runner.attention_backend, gemm_backend=runner.gemm_backend,
        compile_mode=runner.compile_mode, kv_cache_dtype=runner.kv_cache_dtype,
        gpu_memory_utilization=runner.gpu_memory_utilization, swap_space_bytes=runner.swap_space,
        speculative=speculative)


def _default_kv_memory(device: torch.device, gpu_memory_utilization: float) -> int:
    """Bytes left for the KV cache: on CUDA the share of the GPU not yet used (as vLLM sizes it)."""
    if device.type != "cuda":
        return DEFAULT_KV_CACHE_MEMORY
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    free, total = torch.cuda.mem_get_info(device)
    used = total - free
    return int(total * gpu_memory_utilization) - used
