"""The per-CPU choices read from /proc/cpuinfo's format: bfloat16 only with native bfloat16 dot products, which
own kernels run, and the kernels built with this CPU's defines."""

from __future__ import annotations

import pytest

from pagedserve.engine.cpu_features import (BF16_CPU_FLAGS, check_cpu_dtype, cpu_flags, cpu_vendor,
                                            l2_prefetches_preferred, own_kernels_preferred)
from pagedserve.engine.runner_factory import resolve_dtype

X86 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx2 avx512f {extra}\nbugs\t\t: sysret_ss_attrs\n\n" \
      "processor\t: 1\nflags\t\t: fpu\n"
ARM = "processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd sve {extra}\nCPU implementer\t: 0x41\n"


@pytest.mark.parametrize("text, extra, native", [(X86, "avx512_bf16", True), (X86, "amx_bf16 amx_tile", True),
                                                 (X86, "avx512_vnni", False), (ARM, "bf16 i8mm", True),
                                                 (ARM, "sve2", False)])
def test_flags_of_the_first_cpu_decide(tmp_path, text, extra, native):
    (tmp_path / "cpuinfo").write_text(text.format(extra=extra))
    flags = cpu_flags(tmp_path / "cpuinfo")
    assert set(extra.split()) <= flags and {"fpu", "fp"} & flags  # the first CPU's line
    check_cpu_dtype("float32", flags)
    if native:
        check_cpu_dtype("bfloat16", flags)
    else:
        with pytest.raises(ValueError, match="avx512_bf16 or amx_bf16.*its /proc/cpuinfo flags have none.*--dtype float32"):
            check_cpu_dtype("bfloat16", flags)


def test_the_vendor_is_the_first_x86_cpus_and_none_elsewhere(tmp_path):
    (tmp_path / "x86").write_text(X86.format(extra=""))
    (tmp_path / "arm").write_text(ARM.format(extra=""))
    assert cpu_vendor(tmp_path / "x86") == "AuthenticAMD"
    assert cpu_vendor(tmp_path / "arm") is None and cpu_vendor(tmp_path / "missing") is None


def test_unreadable_cpuinfo_refuses_bfloat16_saying_so(tmp_path):
    assert cpu_flags(tmp_path / "missing") == frozenset()
    with pytest.raises(ValueError, match="no /proc/cpuinfo flags could be read"):
        check_cpu_dtype("bfloat16", frozenset())


def test_resolve_dtype_checks_this_cpu():
    native = bool(cpu_flags() & set(BF16_CPU_FLAGS))
    assert resolve_dtype("auto", "cpu") == "float32" and resolve_dtype("auto", "cuda") == "bfloat16"
    assert resolve_dtype("bfloat16", "cuda:0") == "bfloat16"  # GPUs are not checked here
    if native:
        assert resolve_dtype("bfloat16", "cpu") == "bfloat16"
    else:
        with pytest.raises(ValueError, match="--dtype bfloat16 needs a CPU with native bfloat16"):
            resolve_dtype("bfloat16", "cpu")


@pytest.mark.parametrize("flags, vendor, own_kernels, l2_prefetches", [
    ({"avx2", "fma"}, "AuthenticAMD", True, False),               # Zen 3: measured
    ({"avx2", "fma", "avx512f"}, "AuthenticAMD", True, True),     # Zen 4: measured
    ({"avx2", "fma", "avx512f"}, "GenuineIntel", False, False),   # Intel's AVX-512: not measured
    ({"avx2", "fma"}, "GenuineIntel", True, False),
])
def test_own_kernels_and_l2_prefetches_follow_what_was_measured_per_cpu(flags, vendor, own_kernels, l2_prefetches):
    assert own_kernels_preferred(frozenset(flags), vendor) == own_kernels
    assert l2_prefetches_preferred(frozenset(flags), vendor) == l2_prefetches


def test_the_attention_op_and_the_gemms_are_built_with_this_cpus_kernel_defines(monkeypatch):
    """The kernels that read ``PAGEDSERVE_PREFETCH_TO_L2`` are each loaded with ``kernel_defines()``."""
    from pagedserve.engine.attention import cpu_op
    from pagedserve.engine.models import onednn, panel_gemm

    loads = []

    def load_cpu_library(source, prefix, what, fallback, build_dir=None, defines=()):
        loads.append((source.name, defines))
        return False

    monkeypatch.setattr(cpu_op, "load_cpu_library", load_cpu_library)
    monkeypatch.setattr(cpu_op, "kernel_defines", lambda: ("PAGEDSERVE_PREFETCH_TO_L2",))
    monkeypatch.setattr(onednn, "cpu_flags", lambda: frozenset({"avx512_bf16"}))
    monkeypatch.setattr(panel_gemm, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    cpu_op.load_cpu_attention_op()
    onednn.few_rows_available.__wrapped__()
    panel_gemm.panels_available.__wrapped__()
    assert loads == [(name, ("PAGEDSERVE_PREFETCH_TO_L2",)) for name in
                     ("paged_attention_cpu.cpp", "few_rows_bf16.cpp", "panel_gemm_f32.cpp")]
    from pathlib import Path

    sources = Path(cpu_op.__file__).parents[1].glob("**/csrc/*")  # a kernel that reads the flag must be listed above
    readers = {p.name for p in sources if p.suffix in (".cpp", ".h") and "PAGEDSERVE_PREFETCH_TO_L2" in p.read_text()}
    assert readers == {"key_tiles.h", "few_rows_bf16.cpp", "panel_gemm_f32.cpp"}  # key_tiles.h: the attention op's
