"""Linear layers on oneDNN with prepacked weights: the opt-in fast GEMMs for CPU.

oneDNN reorders each weight matrix once into its blocked layout for the CPU's vector units (the
``torch.ops.mkldnn`` ops inductor uses for frozen CPU models). On the 2-core AMD EPYC of
docs/benchmarks.md this runs the model's matmuls 2-3x faster than ``F.linear`` (MKL). The results are
float32 like ``F.linear``'s but summed in another order, so they differ from Hugging Face
``transformers`` in the last bits and greedy decoding can pick another token where two logits
nearly tie: the engine's default stays ``F.linear`` (:attr:`GemmBackend.TORCH`), token-identical to HF.
"""

from __future__ import annotations

import itertools
import weakref

import torch
from torch import nn

from pagedserve.engine.models.layers import Linear

BATCH_HINT = 64  # the token count oneDNN tunes the packed layout for; any count works

_layers: weakref.WeakValueDictionary[int, OneDnnLinear] = weakref.WeakValueDictionary()
_ids = itertools.count()


@torch.library.custom_op("pagedserve::onednn_linear", mutates_args=())
def onednn_linear(x: torch.Tensor, layer_id: int, out_features: int) -> torch.Tensor:
    """``x`` ``[T, in]`` through the packed layer ``layer_id``: ``[T, out_features]``. A custom op so
    that ``torch.compile`` keeps it opaque (inductor cannot take the packed weight as a graph input)."""
    layer = _layers[layer_id]
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), layer.packed_weight, layer.bias, "none", [], "")


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
            raise RuntimeError("--gemm-backend onednn needs a torch build with oneDNN (mkldnn); use --gemm-backend torch")
        self.out_features = weight.shape[0]
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), BATCH_HINT)  # opaque
        self.bias = None if bias is None else bias.detach().clone()
        self.layer_id = next(_ids)
        _layers[self.layer_id] = self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, in]`` -> ``[T, out]``."""
        return onednn_linear(x, self.layer_id, self.out_features)


def pack_linear_layers(model: nn.Module) -> int:
    """Replaces every :class:`Linear` of ``model`` by a :class:`OneDnnLinear` with the same weights.

    A model whose LM head is tied to its embeddings (``lm_head is None``) gets a packed copy of the
    embedding matrix as its ``lm_head``; the embedding table itself stays for token lookups.

    Returns:
        The number of linear layers packed (the LM head included).

    Raises:
        ValueError: the model is not on the CPU.
    """
    if next(model.parameters()).device.type != "cpu":
        raise ValueError("--gemm-backend onednn is for CPU models; use --gemm-backend torch on GPUs")
    packed = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Linear):
                setattr(parent, name, OneDnnLinear(child.weight, child.bias))
                packed += 1
    if model.lm_head is None:
        model.lm_head = OneDnnLinear(model.embed_tokens.weight, None)
        packed += 1
    return packed
