"""What a worker's model runners are built with, and the engine's whole config (scheduler limits and
runners) that ``LLM`` takes."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from pagedserve.engine.config import (ATTENTION_BACKENDS, CompileMode, GemmBackend, KVCacheDtype,
                                      SchedulerConfig, default_token_budget)
from pagedserve.engine.cpu_features import BF16_CPU_FLAGS
from pagedserve.engine.spec_decode.config import SpeculativeConfig
from pagedserve.options import nested, option
from pagedserve.units import format_bytes, parse_bytes, parse_bytes_or_zero

DTYPES = ("auto", "float32", "bfloat16", "float16")
"""Weight and KV-cache dtypes a runner may be built with."""


DEFAULT_KV_CACHE_MEMORY = 1 << 30
"""KV-cache bytes per worker unless told: of ``LLM`` and `pagedserve up` on every device, of a lone
`pagedserve worker` on CPU, and of each rank of a tensor- or pipeline-parallel worker on any device."""


@dataclass(frozen=True)
class RunnerConfig:
    """The model runners of one worker: kernels, memory and the rank grid (fields documented by their
    ``help``). Sizes may be given as strings (``"512MiB"``), enums as their values.

    Raises:
        ValueError: an unknown dtype, backend or mode; a size, share or rank count out of range.
    """

    kv_cache_memory: int | None = option(
        "bytes of K and V cache per worker, e.g. 2GiB or 512MiB; per rank with T*P > 1 ranks",
        None, env="PAGEDSERVE_KV_CACHE_MEMORY", parse=parse_bytes, show=format_bytes,
        default_help=f"{format_bytes(DEFAULT_KV_CACHE_MEMORY)} on CPU, on CUDA what --gpu-memory-utilization "
        "leaves after the weights")
    swap_space: int = option("bytes of CPU memory for swapped-out KV blocks (scheduler --preemption-mode swap), "
                             "e.g. 4GiB; 0: none", 0, parse=parse_bytes_or_zero, show=format_bytes)
    dtype: str = option(
        "weights and activations dtype, and the KV cache's unless --kv-cache-dtype says otherwise; auto: bfloat16 on "
        "CUDA, float32 on CPU; bfloat16 on a CPU needs "
        f"native bfloat16 ({' or '.join(BF16_CPU_FLAGS)} in /proc/cpuinfo; refused without)", "auto", choices=DTYPES)
    kv_cache_dtype: KVCacheDtype = option(
        "what the KV cache stores K and V in (vLLM's flag): auto (the --dtype), bfloat16, or fp8_e5m2 "
        "(torch.float8_e5m2 unscaled: rounded to nearest even, saturating at +-57344); fewer bytes per token, so "
        "more blocks in --kv-cache-memory (fp8_e5m2: 4x float32's); attention reads them back in float32",
        KVCacheDtype.AUTO)
    device: str = option("torch device: cpu or cuda", "cpu")
    attention_backend: str = option(
        "paged attention: auto (Triton on CUDA; on CPU the compiled C++ op for decodes, or plain torch if it "
        "cannot be built), cpu, torch or triton", "auto", choices=ATTENTION_BACKENDS)
    gemm_backend: GemmBackend = option(
        "linear layers: auto (on CPU panels where it is built and measured faster: AVX2 and FMA, not Intel's "
        "AVX-512; else onednn; torch where "
        "torch has no oneDNN; logged), torch (F.linear, transformers' kernels: the reference path), onednn "
        "(weights prepacked for oneDNN: 2-3x faster matmuls on CPU, float32 sums in another order, a row's "
        "result independent of the batch's size) or panels (float32 layers on pagedserve's own AVX2/AVX-512 GEMM, "
        "faster than oneDNN at a few rows and level from 64: docs/benchmarks.md; each row's sums in one order "
        "whatever the batch or CPU; others on oneDNN)",
        GemmBackend.AUTO)
    compile_mode: CompileMode = option(
        "eager: run the model op by op; inductor: torch.compile the layers' dense part (fused RMSNorm, rotary, "
        "SiLU*mul, residual adds; busy decode steps 4-15% shorter on CPU, single-sequence steps slightly longer; "
        "reductions in another order; about 40 s of compiling at start)", CompileMode.EAGER)
    gpu_memory_utilization: float = option("CUDA: share of the GPU's memory the worker may use in all, (0, 1]", 0.9)
    tensor_parallel_size: int = option(
        "ranks that split each layer of the model (Megatron-LM; every architecture, CPU): rank 0 talks to the "
        "scheduler, T-1 helper processes hold the other shards; --kv-cache-memory is per rank", 1)
    pipeline_parallel_size: int = option(
        "pipeline stages of consecutive layers (every architecture, CPU): T*P ranks, rank 0 in stage 0; each "
        "rank caches its stage's layers only; --kv-cache-memory is per rank", 1)
    virtual_engines: int = option(
        "with --pipeline-parallel-size P > 1: virtual engines, each its own worker id <id>/ve<i> (and port) "
        "with 1/V of each rank's KV budget, whose plans overlap in the stages; 0: P", 0)

    def __post_init__(self) -> None:
        for name, parse in (("kv_cache_memory", parse_bytes), ("swap_space", parse_bytes_or_zero)):
            if isinstance(getattr(self, name), str):
                object.__setattr__(self, name, parse(getattr(self, name)))
        object.__setattr__(self, "gemm_backend", GemmBackend(self.gemm_backend))
        object.__setattr__(self, "compile_mode", CompileMode(self.compile_mode))
        object.__setattr__(self, "kv_cache_dtype", KVCacheDtype(self.kv_cache_dtype))
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"--attention-backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        if (self.kv_cache_memory is not None and self.kv_cache_memory < 1) or self.swap_space < 0:
            raise ValueError(f"--kv-cache-memory must be positive and --swap-space at least 0, got "
                             f"{self.kv_cache_memory} and {self.swap_space}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"--tensor-parallel-size must be >= 1, got {self.tensor_parallel_size}")
        if self.pipeline_parallel_size < 1:
            raise ValueError(f"--pipeline-parallel-size must be >= 1, got {self.pipeline_parallel_size}")
        if self.virtual_engines < 0 or (self.virtual_engines > 1 and self.pipeline_parallel_size == 1):
            raise ValueError(f"virtual_engines={self.virtual_engines}: give 1, or more than 1 with "
                             "pipeline_parallel_size > 1 (0: one per pipeline stage)")

    @property
    def ranks(self) -> int:
        """Ranks of one worker: ``tensor_parallel_size * pipeline_parallel_size``."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def num_virtual_engines(self) -> int:
        """Virtual engines of one worker: ``virtual_engines``, or one per pipeline stage when 0."""
        return self.virtual_engines or self.pipeline_parallel_size


RANK_GRID = frozenset({"tensor_parallel_size", "pipeline_parallel_size", "virtual_engines"})
"""The fields of RunnerConfig that shape a worker's ranks."""

KERNELS = frozenset({"gemm_backend", "compile_mode", "kv_cache_dtype"})
"""The fields of RunnerConfig that pick the model's kernels (and what the KV cache stores)."""


def kernel_options(flags: Any) -> dict[str, Any]:
    """The :data:`KERNELS` fields of parsed flags (an ``argparse.Namespace`` with them), by name: the
    options a benchmark passes on to ``LLM`` or ``RunnerConfig``."""
    return {name: getattr(flags, name) for name in KERNELS}


@dataclass(frozen=True)
class EngineConfig:
    """The in-process engine (``pagedserve.llm.LLM``): scheduler limits, the runners of each worker,
    speculative decoding (a :class:`SpeculativeConfig` or a dict of its fields, as vLLM's
    ``speculative_config``), and how many workers (each with its own weights and KV cache)."""

    scheduler: SchedulerConfig = nested("scheduler limits", SchedulerConfig())
    runner: RunnerConfig = nested("model runners", RunnerConfig(kv_cache_memory=DEFAULT_KV_CACHE_MEMORY))
    speculative_config: SpeculativeConfig = nested("speculative decoding", SpeculativeConfig())
    num_workers: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.speculative_config, dict):
            object.__setattr__(self, "speculative_config", SpeculativeConfig(**self.speculative_config))
        if self.num_workers < 1:
            raise ValueError(f"num_workers must be at least 1, got {self.num_workers}")

    @classmethod
    def of(cls, **options: Any) -> EngineConfig:
        """The default config with ``options`` set, each by its field name in whichever part holds
        it (``EngineConfig.of(block_size=8, device="cuda")``). The token budget defaults to
        :func:`~pagedserve.engine.config.default_token_budget` of the device.

        Raises:
            TypeError: an option no part has.
            ValueError: an invalid value.
        """
        parts: dict[str, dict[str, Any]] = {"scheduler": {}, "runner": {}}
        top = {}
        for name, value in options.items():
            owner = next((p for p, kind in (("scheduler", SchedulerConfig), ("runner", RunnerConfig))
                          if name in {f.name for f in dataclasses.fields(kind)}), None)
            if owner is None and name not in {f.name for f in dataclasses.fields(cls)} - set(parts):
                raise TypeError(f"unknown engine option {name!r}")
            (parts[owner] if owner else top)[name] = value
        runner = dataclasses.replace(cls.runner, **parts["runner"])
        budget = {"max_num_batched_tokens": default_token_budget(runner.device)}
        return cls(SchedulerConfig(**{**budget, **parts["scheduler"]}), runner, **top)
