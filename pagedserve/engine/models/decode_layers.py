"""A Llama-family model's decoder layers for a decode step in one C++ call (``csrc/decode_layers.cpp``).

Eager layers cost ~40 Python-level calls each (~170 us a layer on the 2-core Xeon of
docs/benchmarks.md, a third of a batch-1 step); the C++ loop makes the same calls with the same
kernels, so its hidden states are bit-identical (tests/worker/test_decode_layers.py). It takes a step
when every token is a decode of its own sequence and the layers are the plain Llama ones on the CPU
path: oneDNN or panel linear layers (``models/onednn.py``, ``models/panel_gemm.py``), the fused
row-wise ops, the C++ attention op, K/V cached in the model's dtype, one rank. Any other step, model
or setting runs the Python layers.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedserve.engine.attention.cpu_backend import CpuAttentionBackend
from pagedserve.engine.attention.cpu_op import LANES, load_cpu_library
from pagedserve.engine.attention.step import StepAttention
from pagedserve.engine.models import onednn
from pagedserve.engine.models.fused_ops import DTYPES, fused_ops_available
from pagedserve.engine.models.panel_gemm import PanelLinear

SOURCE = Path(__file__).parent / "csrc" / "decode_layers.cpp"


@functools.cache
def decode_layers_available() -> bool:
    """Whether the loop's library is built and loaded, with the fused ops it calls (on first use)."""
    return fused_ops_available() and load_cpu_library(SOURCE, "pagedserve_decode_layers",
                                                      "the C++ decode-step layer loop", "the Python layers")


@dataclass(frozen=True)
class DecodeLayers:
    """The weights the loop reads, gathered once from a packed model (:meth:`build`).

    Attributes:
        norms: per layer its input and post-attention RMSNorm weights ``[hidden]``.
        packed, bias, pairs, pair_bias: per layer its q/k/v, output, gate/up and down projections, as
            :class:`~pagedserve.engine.models.onednn.OneDnnLinear` holds them (``None`` for a panel layer).
        panels, out_features: each projection's :class:`~pagedserve.engine.models.panel_gemm.PanelLinear`
            panels (``None`` for a oneDNN layer) and output width.
        num_heads, num_kv_heads, head_dim, scale, eps: the attention geometry and the norms' epsilon.
    """

    norms: tuple[torch.Tensor, ...]
    packed: tuple[torch.Tensor | None, ...]
    bias: tuple[torch.Tensor | None, ...]
    pairs: tuple[torch.Tensor | None, ...]
    pair_bias: tuple[torch.Tensor | None, ...]
    panels: tuple[torch.Tensor | None, ...]
    out_features: tuple[int, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    eps: float

    @classmethod
    def build(cls, model: torch.nn.Module) -> DecodeLayers | None:
        """The loop for ``model``, whose layers the caller found to be plain Llama layers
        (``LlamaForCausalLM.use_decode_layers``), or ``None`` when it does not apply: layers that are
        not oneDNN or panel ones (which exist on the CPU only), more than one rank, a dtype the fused ops
        lack, a head size the attention op cannot take, or no library."""
        layers = list(model.layers)
        if model.parallel is not None or model.stage is not None or model.dtype not in DTYPES \
                or not decode_layers_available():
            return None
        linears = [m for layer in layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                   layer.mlp.gate_up_proj, layer.mlp.down_proj)]
        attention = layers[0].self_attn
        eps = {layer.input_layernorm.eps for layer in layers} | {layer.post_attention_layernorm.eps for layer in layers}
        if (not all(isinstance(m, (onednn.OneDnnLinear, PanelLinear)) for m in linears) or len(eps) != 1
                or attention.head_dim % LANES):
            return None
        dnn = [m if isinstance(m, onednn.OneDnnLinear) else None for m in linears]
        return cls(norms=tuple(w for layer in layers for w in (layer.input_layernorm.weight,
                                                                layer.post_attention_layernorm.weight)),
                   packed=tuple(None if m is None else m.packed_weight for m in dnn),
                   bias=tuple(m.bias for m in linears), pairs=tuple(None if m is None else m.pairs for m in dnn),
                   pair_bias=tuple(None if m is None else m.float_bias for m in dnn),
                   panels=tuple(m.panels if isinstance(m, PanelLinear) else None for m in linears),
                   out_features=tuple(m.out_features for m in linears),
                   num_heads=attention.num_heads, num_kv_heads=attention.num_kv_heads,
                   head_dim=attention.head_dim, scale=attention.scale, eps=eps.pop())

    def takes(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: object) -> bool:
        """Whether the loop runs this step: every token a decode of its own sequence, the C++
        attention op, K/V cached in ``x``'s dtype, contiguous rotary tables (a compiled forward never
        gets here: runner_factory gives the loop to eager models only)."""
        if not isinstance(attention, StepAttention) or not isinstance(attention.backend, CpuAttentionBackend):
            return False
        metadata = attention.metadata
        return (metadata.num_decode_seqs == x.shape[0] == metadata.seq_lens.shape[0]
                and attention.kv_cache.spec.dtype == x.dtype and cos.dtype == x.dtype and cos.is_contiguous()
                and sin.is_contiguous())

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: StepAttention) -> torch.Tensor:
        """``x`` ``[T, hidden]`` through every layer (updated in place and returned); ``cos``/``sin``
        ``[T, 1, D/2]``; writes each layer's K/V into ``attention``'s cache (see :meth:`takes`)."""
        metadata, cache = attention.metadata, attention.kv_cache
        torch.ops.pagedserve_layers.decode_layers(
            x, cos, sin, self.norms, self.packed, self.bias, self.pairs, self.pair_bias, self.panels,
            self.out_features, cache.key_caches, cache.value_caches, metadata.slot_mapping, metadata.block_tables,
            metadata.seq_lens, metadata.query_start_loc, self.num_heads, self.num_kv_heads, self.head_dim,
            self.scale, self.eps, onednn.few_rows(), onednn.MIN_ROWS)
        return x
