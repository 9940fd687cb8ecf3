"""Float32 linear layers on pagedserve's own GEMM (``csrc/panel_gemm_f32.cpp``): ``--gemm-backend panels``,
the default on x86 CPUs with AVX2 and FMA but for Intel's with AVX-512 (unmeasured there:
``cpu_features.own_kernels_preferred``).

The weight is packed once into panels of 16 output columns; a block of 6 rows x 16 columns (AVX2) or 6 x
64 (AVX-512: 4 panels) of sums stays in registers (the BLIS scheme). Each output is summed over k in
order, one fused multiply-add per k, whatever the batch: a row's result is the same bits alone, in a
batch of any size, on any number of threads and with either instruction set, so one row is not padded
to two as oneDNN's are (:data:`~pagedserve.engine.models.onednn.MIN_ROWS`). How it compares with
oneDNN's packed kernels per row count and end to end: docs/benchmarks.md, "pagedserve's float32 GEMM
on AVX2" and "The panel GEMM on AVX-512" (`pagedserve bench gemm-rows --dtype float32`).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from torch import nn

from pagedserve.engine.cpu_features import cpu_flags, cpu_vendor, own_kernels_preferred
from pagedserve.engine.models.huge_pages import HugePageArena

SOURCE = Path(__file__).parent / "csrc" / "panel_gemm_f32.cpp"
PANEL_COLUMNS = 16
"""Output columns of a panel (the kernel's ``kCols``, which checks the panels' shape)."""


def panel_shape(out_features: int, in_features: int) -> tuple[int, int, int]:
    """The packed panels' shape for an ``[out_features, in_features]`` weight: ``[ceil(out / 16), in, 16]``."""
    return -(-out_features // PANEL_COLUMNS), in_features, PANEL_COLUMNS
UNAVAILABLE = ("--gemm-backend panels needs an x86 CPU with AVX2 and FMA and a C++ compiler (g++, ninja) to build "
               "it; use --gemm-backend auto or onednn")


@functools.cache
def panels_available() -> bool:
    """Whether this CPU has AVX2 and FMA and the GEMM's library is built and loaded (on first use)."""
    if not {"avx2", "fma"} <= cpu_flags():
        return False
    from pagedserve.engine.attention.cpu_op import kernel_defines, load_cpu_library

    if not load_cpu_library(SOURCE, "pagedserve_panel_gemm", "pagedserve's float32 GEMM", "oneDNN's GEMMs",
                            defines=kernel_defines()):
        return False
    _register_fake()
    return True


@functools.cache
def _register_fake() -> None:
    """The op's output shape for ``torch.compile`` (once a process: a second registration raises)."""
    torch.library.register_fake("pagedserve_panels::panel_linear")(
        lambda x, panels, bias, out_features: x.new_empty(x.shape[0], out_features))


def panels_preferred() -> bool:
    """Whether ``--gemm-backend auto`` takes these GEMMs: where :func:`own_kernels_preferred` says they were
    measured faster than oneDNN's, and available."""
    return own_kernels_preferred(cpu_flags(), cpu_vendor()) and panels_available()


class PanelLinear(nn.Module):
    """``y = x @ weight.T + bias`` in float32 with ``weight`` ``[out, in]`` packed once into panels.

    Args:
        weight: ``[out, in]`` float32 on the CPU (copied into ``[ceil(out / 16), in, 16]`` panels).
        bias: ``[out]`` or ``None``.
        arena: where the panels go (2 MiB pages: the GEMMs of a few rows read them at the memory's speed).

    Raises:
        RuntimeError: the CPU lacks AVX2 or FMA, or the library cannot be built (:func:`panels_available`).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, arena: HugePageArena) -> None:
        super().__init__()
        if not panels_available():
            raise RuntimeError(UNAVAILABLE)
        out_features, in_features = weight.shape
        self.out_features = out_features
        self.panels = arena.empty(panel_shape(out_features, in_features), torch.float32)
        torch.ops.pagedserve_panels.pack_panels(weight.detach().float(), self.panels)
        self.bias = None if bias is None else bias.detach().float().contiguous().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, in]`` float32 -> ``[T, out]`` float32."""
        return torch.ops.pagedserve_panels.panel_linear(x.contiguous(), self.panels, self.bias, self.out_features)
