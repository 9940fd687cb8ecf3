"""Linear layers on oneDNN with prepacked weights: the default GEMMs on CPU (``--gemm-backend auto``)
but for float32 layers on x86 CPUs with AVX2 and FMA, which take ``models/panel_gemm.py``.

oneDNN reorders each weight matrix once into its blocked layout for the CPU's vector units (the
``torch.ops.mkldnn`` ops inductor uses for frozen CPU models). On the 2-core AMD EPYC of
docs/benchmarks.md this runs the model's matmuls 2-3x faster than ``F.linear`` (MKL), float32 or
bfloat16 weights alike. The float32 results are about as exact as MKL's (relative error against
float64 0.8-1.0e-6 vs 0.3-0.5e-6 on the default model's shapes) but summed in another order, so they
differ from Hugging Face ``transformers`` in the last bits; neither path is bit-identical to HF's,
whose batches have other row counts (MKL's rows change with the row count of the batch:
scripts/gemm_batch_invariance.py). oneDNN's do not, from two rows up; a single row is run as two
(:data:`MIN_ROWS`), so a token's logits do not depend on what else is in the step. That holds for
float32; on CPUs with AMX, oneDNN takes other bfloat16 kernels from 33 rows up (on a 2-core Xeon,
rows computed in batches of up to 32 differed in the last bits from the same rows in a batch of 257
on most of the default model's shapes), so there a bfloat16 token's logits may change with the
step's size.

bfloat16 layers on a CPU with AVX512_BF16 also keep their weight packed for
``csrc/few_rows_bf16.cpp``, which runs steps of up to :func:`few_rows` rows (decodes of a few
sequences, batch-1 TPOT; on CPUs without AMX whole decode batches) near the memory bandwidth, 1.7-2.0x
oneDNN's speed at 1-4 rows; the cost is a second copy of the bfloat16 weights. Its rows do not depend on
the row count up to :func:`few_rows`, so one row is not padded; past it oneDNN's kernels take over.
``--gemm-backend torch`` keeps ``F.linear`` as the reference path.
"""

from __future__ import annotations

import functools
import itertools
import logging
import weakref
from pathlib import Path

import torch
from torch import nn

from pagedserve.engine.config import GemmBackend
from pagedserve.engine.cpu_features import AMD, cpu_flags, cpu_vendor
from pagedserve.engine.models.layers import Linear
from pagedserve.engine.models.huge_pages import HugePageArena
from pagedserve.engine.models.panel_gemm import UNAVAILABLE, PanelLinear, panels_available, panels_preferred

log = logging.getLogger("pagedserve.worker")

BATCH_HINT = 64  # the token count oneDNN tunes the packed layout for; any count works
MIN_ROWS = 2
"""Rows of the smallest GEMM run: oneDNN takes another kernel (a GEMV, with another summation order
for inputs wider than about 1024) for one row, so a single row is padded with a zero row. Two rows
cost the same time as one (the weights dominate: scripts/gemm_batch_invariance.py times both).
Asserted for the default model's shapes in tests/worker/test_onednn_linear.py."""

FEW_ROWS = 8
"""Rows up to which a bfloat16 layer runs the few-row kernel (``csrc/few_rows_bf16.cpp``) on a CPU with
AMX, where oneDNN's bfloat16 kernels use it: on the 2-core Xeon it read the default model's weights at
15-17 GB/s for 1-4 rows (oneDNN 8.4-8.5), 1.1x oneDNN's speed at 8 rows, 0.8x at 12 (`pagedserve bench
gemm-rows`; docs/benchmarks.md, "The attention op regrouped, and few-row bfloat16 GEMMs")."""
FEW_ROWS_AMD = 256
"""The same limit on AMD's CPUs with AVX512_BF16 (no AMX: both kernels run the same dot-product
instruction): on the Zen 4 EPYC the kernel was 1.67x oneDNN's speed at 1 row, 1.15x at 16, 1.08x at 64,
1.03x at 128 and 256, and even (0.98-1.00x) at 512-2048 rows (docs/benchmarks.md, "Few-row bfloat16 GEMMs
for whole decode batches on Zen 4"). Intel's CPUs without AMX keep :data:`FEW_ROWS` (not measured)."""
FEW_ROWS_SOURCE = Path(__file__).parent / "csrc" / "few_rows_bf16.cpp"

_layers: weakref.WeakValueDictionary[int, OneDnnLinear] = weakref.WeakValueDictionary()
_ids = itertools.count()


@functools.cache
def few_rows_available() -> bool:
    """Whether this CPU has AVX512_BF16 and the few-row kernel is built (on first use, as the attention op)."""
    if "avx512_bf16" not in cpu_flags():
        return False
    from pagedserve.engine.attention.cpu_op import kernel_defines, load_cpu_library

    return load_cpu_library(FEW_ROWS_SOURCE, "pagedserve_few_rows_bf16", "the few-row bfloat16 GEMM for CPU",
                            "oneDNN for every row count", defines=kernel_defines())


def few_rows_limit(flags: frozenset[str], vendor: str | None) -> int:
    """Rows up to which bfloat16 layers run the few-row kernel on a CPU with these flags and vendor
    (:func:`~pagedserve.engine.cpu_features.cpu_flags`, ``cpu_vendor``): where measured, :data:`FEW_ROWS`
    with AMX, :data:`FEW_ROWS_AMD` on AMD's CPUs (none has AMX); :data:`FEW_ROWS` elsewhere."""
    return FEW_ROWS_AMD if vendor == AMD and "amx_bf16" not in flags else FEW_ROWS


@functools.cache
def few_rows() -> int:
    """:func:`few_rows_limit` of this CPU (read once a process: every layer call asks)."""
    return few_rows_limit(cpu_flags(), cpu_vendor())


def packed_linear(x: torch.Tensor, layer: OneDnnLinear) -> torch.Tensor:
    """``x`` ``[T, in]`` through ``layer``'s packed weight: ``[T, out]`` (up to :func:`few_rows` rows of
    a bfloat16 layer through the few-row kernel; else a single row run as :data:`MIN_ROWS`)."""
    rows = x.shape[0]
    if layer.pairs is not None and rows <= few_rows():
        return torch.ops.pagedserve_gemm.few_rows_linear(x.contiguous(), layer.pairs, layer.float_bias)
    if rows < MIN_ROWS:
        x = torch.cat([x, x.new_zeros(MIN_ROWS - rows, x.shape[1])])
    out = torch.ops.mkldnn._linear_pointwise(x.contiguous(), layer.packed_weight, layer.bias, "none", [], "")
    return out[:rows]


@torch.library.custom_op("pagedserve::onednn_linear", mutates_args=())
def onednn_linear(x: torch.Tensor, layer_id: int, out_features: int) -> torch.Tensor:
    """:func:`packed_linear` of the layer ``layer_id`` as a custom op, so that ``torch.compile`` keeps it
    opaque (inductor cannot take the packed weight as a graph input). Eager calls skip it: its
    dispatch costs 70-110 us a call on the 2-core Xeon (a third of a 4-row GEMM's time)."""
    return packed_linear(x, _layers[layer_id])


@onednn_linear.register_fake
def _(x, layer_id, out_features):
    return x.new_empty(x.shape[0], out_features)


class OneDnnLinear(nn.Module):
    """``y = x @ weight.T + bias`` through oneDNN with ``weight`` ``[out, in]`` packed once.

    Args:
        weight: ``[out, in]`` float32 or bfloat16 on the CPU (copied into the packed layout).
        bias: ``[out]`` or ``None``.

    Raises:
        RuntimeError: this torch build has no oneDNN (``torch.backends.mkldnn.is_available()``).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        if not torch.backends.mkldnn.is_available():
            raise RuntimeError("--gemm-backend onednn needs a torch build with oneDNN (mkldnn); use --gemm-backend "
                               "auto or torch")
        self.out_features = weight.shape[0]
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), BATCH_HINT)  # opaque
        self.bias = None if bias is None else bias.detach().clone()
        has_pairs = (weight.dtype == torch.bfloat16 and weight.shape[0] % 16 == 0 and weight.shape[1] % 2 == 0
                     and few_rows_available())
        self.pairs = torch.ops.pagedserve_gemm.pack_pairs(weight.detach()) if has_pairs else None  # [out/16, in/2, 16, 2]
        self.float_bias = None if bias is None or not has_pairs else bias.detach().float()
        self.layer_id = next(_ids)
        _layers[self.layer_id] = self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, in]`` -> ``[T, out]``: through the custom op while ``torch.compile`` traces, directly otherwise."""
        if torch.compiler.is_compiling():
            return onednn_linear(x, self.layer_id, self.out_features)
        return packed_linear(x, self)


def packed_layer(weight: torch.Tensor, bias: torch.Tensor | None, backend: GemmBackend,
                 arena: HugePageArena) -> nn.Module:
    """``weight`` and ``bias`` packed for ``backend``: a :class:`PanelLinear` for a float32 weight under
    ``panels`` (its panels in ``arena``), else a :class:`OneDnnLinear` (oneDNN allocates its own)."""
    if backend is GemmBackend.PANELS and weight.dtype == torch.float32:
        return PanelLinear(weight, bias, arena)
    return OneDnnLinear(weight, bias)


def pack_linear_layers(model: nn.Module, backend: GemmBackend = GemmBackend.ONEDNN) -> int:
    """Replaces every :class:`Linear` of ``model`` by its :func:`packed_layer` with the same weights.

    A model whose LM head is tied to its embeddings (``lm_head is None``) gets a packed copy of the
    embedding matrix as its ``lm_head``; the embedding table itself stays for token lookups. The
    model's panels share one :class:`HugePageArena`.

    Returns:
        The number of linear layers packed (the LM head included).

    Raises:
        ValueError: the model is not on the CPU.
    """
    if next(model.parameters()).device.type != "cpu":
        raise ValueError(f"--gemm-backend {backend.value} is for CPU models; use --gemm-backend torch on GPUs")
    packed, arena = 0, HugePageArena()
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Linear):
                setattr(parent, name, packed_layer(child.weight, child.bias, backend, arena))
                packed += 1
    if model.lm_head is None:
        model.lm_head = packed_layer(model.embed_tokens.weight, None, backend, arena)
        packed += 1
    return packed


def resolve_gemm_backend(backend: GemmBackend | str, device: torch.device | str) -> GemmBackend:
    """``auto`` -> on the CPU ``panels`` where :func:`panels_preferred`, else ``onednn`` when this torch
    has oneDNN, else ``torch`` (logged with the reason); the others unchanged (:func:`pack_linear_layers`
    refuses packed layers off the CPU).

    Raises:
        ValueError: ``panels`` on a CPU without AVX2 and FMA, or where its library cannot be built.
    """
    backend = GemmBackend(backend)
    if backend is GemmBackend.PANELS and not panels_available():
        raise ValueError(UNAVAILABLE)
    if backend is not GemmBackend.AUTO:
        return backend
    if torch.device(device).type != "cpu":
        log.info("--gemm-backend auto: torch GEMMs (F.linear) on %s; oneDNN prepacking is for CPUs", device)
        return GemmBackend.TORCH
    if not torch.backends.mkldnn.is_available():
        log.warning("--gemm-backend auto: torch GEMMs (F.linear, 2-3x slower on CPU): this torch build has no "
                    "oneDNN (torch.backends.mkldnn.is_available() is False); install torch's CPU wheel")
        return GemmBackend.TORCH
    return GemmBackend.PANELS if panels_preferred() else GemmBackend.ONEDNN
