"""The model's dense part compiled by ``torch.compile`` (inductor), paged attention left opaque.

Between the GEMMs a decoder layer runs a dozen small element-wise ops (RMSNorm, rotary, SiLU*mul,
residual adds), each a pass over the activations plus an eager dispatch. Inductor fuses them into a
few generated C++ loops; on the 2-core CPU of docs/benchmarks.md decode steps of 16 to 256
sequences get 4-15% shorter (a single-sequence step gets about 2 ms longer). As in vLLM's compiled models, attention stays out of the graph: each layer calls a
custom op (``pagedserve::paged_attention``) that looks up the step's
:class:`~pagedserve.engine.attention.step.StepAttention` by the forward's registry id, so the graph
depends on no block table, length or batch composition, and one graph (symbolic token count) serves
every step; inductor specializes a single-token step into a second graph. oneDNN linear layers are
custom ops too (``pagedserve::onednn_linear``, see ``onednn.py``): inductor cannot take their packed
weights as graph inputs; panel layers call their op (``pagedserve_panels::panel_linear``, with a fake
registered in ``panel_gemm.py``) on plain tensors. Mixtral's routed expert dispatch (``pagedserve::moe_experts``, see
``mixtral.py``) is a custom op as well: its per-expert token counts are data-dependent shapes.

Inductor sums RMSNorm's squares in another order than eager torch, so greedy output can differ
from transformers where two logits nearly tie: the mode is opt-in (:attr:`CompileMode.INDUCTOR`).
"""

from __future__ import annotations

import itertools
import weakref

import torch
from torch import nn

from pagedserve.engine.attention.step import StepAttention

_forwards: weakref.WeakValueDictionary[int, CompiledForward] = weakref.WeakValueDictionary()
_ids = itertools.count()


@torch.library.custom_op("pagedserve::paged_attention", mutates_args=())
def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, forward_id: int,
                    layer_index: int, scale: float, alibi_slopes: torch.Tensor | None = None,
                    alibi_bf16: bool = False) -> torch.Tensor:
    """The current step's attention of compiled forward ``forward_id`` for one layer: writes the K/V
    into the cache (a side effect the graph does not see; the output depends on it) and returns
    ``[T, H, D]`` (``alibi_slopes`` float32 ``[H]`` and ``alibi_bf16``: ALiBi models only)."""
    return _forwards[forward_id].step_attention(query, key, value, layer_index, scale, alibi_slopes, alibi_bf16)


@paged_attention.register_fake
def _(query, key, value, forward_id, layer_index, scale, alibi_slopes=None, alibi_bf16=False):
    return torch.empty_like(query)


class _OpaqueAttention:
    """What the compiled graph calls as ``attention``: the custom op bound to one forward's id."""

    def __init__(self, forward_id: int) -> None:
        self.forward_id = forward_id

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_index: int,
                 scale: float, alibi_slopes: torch.Tensor | None = None, alibi_bf16: bool = False) -> torch.Tensor:
        return paged_attention(query, key, value, self.forward_id, layer_index, scale, alibi_slopes, alibi_bf16)


class CompiledForward:
    """``model(input_ids, positions, attention)`` with the model compiled once by inductor.

    Args:
        model: a model with ``forward(input_ids, positions, attention)`` (see ``llama.py``).

    The first calls compile (tens of seconds on two cores; inductor caches the generated code on
    disk, so later processes start faster): call :meth:`ModelRunner.warm_up` before serving.
    """

    def __init__(self, model: nn.Module) -> None:
        self.id = next(_ids)
        _forwards[self.id] = self
        self.step_attention: StepAttention | None = None
        self._opaque = _OpaqueAttention(self.id)
        self._compiled = torch.compile(model, dynamic=True)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: StepAttention) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` for int64 ``input_ids`` and ``positions`` ``[T]``."""
        self.step_attention = attention
        try:
            return self._compiled(input_ids, positions, self._opaque)
        finally:
            self.step_attention = None
