"""What the CPU can do natively, from its feature flags: whether bfloat16 weights are worth running."""

from __future__ import annotations

from pathlib import Path

BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")
"""/proc/cpuinfo flags of native bfloat16 dot products: x86 AVX512_BF16 and AMX-BF16, Arm's BF16.
Without one, oneDNN emulates bfloat16 GEMMs in float32 and they run several times slower."""

AMD = "AuthenticAMD"
"""The ``vendor_id`` of AMD's x86 CPUs (:func:`cpu_vendor`), on which the per-CPU choices below were measured."""

ONEDNN_BF16_CPU_FLAGS = ("avx512bw", "avx_ne_convert")
"""/proc/cpuinfo flags without one of which oneDNN has no bfloat16 GEMM at all (torch's
``mkldnn_reorder_linear_weight`` raises: it needs AVX512BW/VL/DQ or AVX-NE-CONVERT)."""


def _first_cpu_field(cpuinfo: Path, keys: tuple[str, ...]) -> str | None:
    """The value of the first line of ``cpuinfo`` whose key is one of ``keys`` (the first CPU's), ``None``
    when there is none or the file cannot be read (not Linux)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in keys:
            return value.strip()
    return None


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The feature flags of the first CPU in ``cpuinfo`` (x86 ``flags``, Arm ``Features``); empty when
    the file cannot be read (not Linux)."""
    return frozenset((_first_cpu_field(cpuinfo, ("flags", "Features")) or "").split())


def cpu_vendor(cpuinfo: Path = Path("/proc/cpuinfo")) -> str | None:
    """The first x86 CPU's ``vendor_id`` (``AuthenticAMD``, ``GenuineIntel``); ``None`` elsewhere."""
    return _first_cpu_field(cpuinfo, ("vendor_id",))


def own_kernels_preferred(flags: frozenset[str], vendor: str | None) -> bool:
    """Whether pagedserve's own float32 CPU kernels, the panel GEMM (``models/csrc/panel_gemm_f32.cpp``)
    and the prefill attention op (``attention/csrc/prefill_attention_cpu.cpp``), are preferred to oneDNN's
    GEMMs and torch's attention on a CPU with these flags and vendor (:func:`cpu_flags`,
    :func:`cpu_vendor`), where they can run (AVX2 and FMA): where they were measured faster, on CPUs
    without AVX-512 (a Zen 3 EPYC) and on AMD's with it (a Zen 4 EPYC, whose 512-bit fused multiply-adds
    run on two 256-bit units: the panels 1.3-1.7x oneDNN at 1-8 rows, the prefill op 1.4-2.1x torch's).
    Intel's AVX-512 CPUs, with two 512-bit FMA units a core on Xeons, were not measured and keep oneDNN
    and torch (docs/benchmarks.md, "The panel GEMM on AVX-512" and "The prefill op on AVX-512, and for
    bfloat16 models")."""
    return "avx512f" not in flags or vendor == AMD


def l2_prefetches_preferred(flags: frozenset[str], vendor: str | None) -> bool:
    """Whether pagedserve's C++ kernels prefetch what they stream into L2 (built with
    ``PAGEDSERVE_PREFETCH_TO_L2``, :func:`~pagedserve.engine.attention.cpu_op.kernel_defines`) on a CPU with these
    flags and vendor: on AMD's AVX-512 CPUs, where each was measured faster on a Zen 4 EPYC (the decode attention
    op's next key tile into L2 rather than L1, as V's: docs/benchmarks.md, "Key prefetches into L2 on Zen 4"; the
    few-row bfloat16 and the float32 panel GEMMs' weights 16 lines ahead: "Batch 1 on Zen 4: weight prefetches
    in the GEMMs"); not on AMD's without AVX-512 (a Zen 3 EPYC: every attention line into L2 was 0.98x for
    float32, 0.84x for fp8_e5m2) nor Intel's (not measured)."""
    return "avx512f" in flags and vendor == AMD


def check_cpu_dtype(dtype: str, flags: frozenset[str]) -> None:
    """Refuses ``bfloat16`` on a CPU whose ``flags`` (:func:`cpu_flags`) hold none of ``BF16_CPU_FLAGS``.

    Raises:
        ValueError: naming the flags looked for and what to do instead.
    """
    if dtype == "bfloat16" and not flags & set(BF16_CPU_FLAGS):
        found = "no /proc/cpuinfo flags could be read" if not flags else "its /proc/cpuinfo flags have none"
        raise ValueError(f"--dtype bfloat16 needs a CPU with native bfloat16 ({' or '.join(BF16_CPU_FLAGS)}); "
                         f"{found}, and emulated bfloat16 runs slower than float32: use --dtype float32 "
                         "(or auto) on this machine")
