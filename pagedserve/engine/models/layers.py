"""Building blocks shared by the decoder models: linear, embedding, RMSNorm, LayerNorm, SwiGLU and GELU MLPs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.engine.models.fused_ops import add_rms_norm, rms_norm, silu_and_mul


class Linear(nn.Module):
    """``y = x @ weight.T + bias`` with ``weight`` ``[out, in]``; storage is allocated uninitialised
    (the weight loader fills it), which keeps building a large model fast.

    Args:
        in_features, out_features: widths.
        bias: whether a ``[out]`` bias exists.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device),
                                   requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False)
                     if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, in]`` -> ``[T, out]``."""
        return F.linear(x, self.weight, self.bias)


class Embedding(nn.Module):
    """Token embedding table ``weight`` ``[vocab, hidden]`` (uninitialised until loaded)."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype, device=device),
                                   requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """int64 ``[T]`` -> ``[T, hidden]``."""
        return F.embedding(input_ids, self.weight)


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (Zhang & Sennrich, 2019): ``x / sqrt(mean(x**2) + eps) * weight``.

    Args:
        hidden_size: width of the normalised (last) dimension.
        eps: added to the mean square.
    """

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., hidden]`` -> ``[..., hidden]``, same dtype."""
        return rms_norm(x, self.weight, self.eps)

    def add_then_norm(self, residual: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """``residual += delta`` (in place), then this norm of it: ``[T, hidden]`` -> ``[T, hidden]``
        (one pass on CPU)."""
        return add_rms_norm(residual, delta, self.weight, self.eps)


class GatedMLP(nn.Module):
    """SwiGLU feed-forward (Shazeer, 2020): ``down(silu(gate(x)) * up(x))`` with gate and up fused
    into one ``[2 * intermediate, hidden]`` matrix (gate rows first).

    Args:
        hidden_size, intermediate_size: widths.
        bias: whether the three projections carry biases.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias, dtype, device)
        self.down_proj = Linear(intermediate_size, hidden_size, bias, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, hidden]`` -> ``[T, hidden]``."""
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))         # (T, 2I) -> (T, I) -> (T, hidden)


class LayerNorm(nn.Module):
    """Layer normalisation (Ba et al., 2016): ``(x - mean) / sqrt(var + eps) * weight + bias`` over
    the last dimension, as ``torch.nn.LayerNorm`` (GPT-NeoX, Falcon).

    Args:
        hidden_size: width of the normalised (last) dimension.
        eps: added to the variance.
        bias: whether a ``[hidden]`` bias exists.
    """

    def __init__(self, hidden_size: int, eps: float, bias: bool, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=dtype, device=device), requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(hidden_size, dtype=dtype, device=device), requires_grad=False)
                     if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, hidden]`` -> ``[T, hidden]``, same dtype."""
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class GeluMLP(nn.Module):
    """Two-layer GELU feed-forward (Hendrycks & Gimpel, 2016): ``c_proj(gelu(c_fc(x)))``, as in GPT-2.

    Args:
        hidden_size, intermediate_size: widths.
        bias: whether both projections carry biases.
        approximate: ``"tanh"`` (GPT-2's ``gelu_new``) or ``"none"`` (the exact erf GELU).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, approximate: str,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.approximate = approximate
        self.c_fc = Linear(hidden_size, intermediate_size, bias, dtype, device)
        self.c_proj = Linear(intermediate_size, hidden_size, bias, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, hidden]`` -> ``[T, hidden]``."""
        h = F.gelu(self.c_fc(x), approximate=self.approximate)           # (T, I)
        return self.c_proj(h)                                             # (T, hidden)


def lm_head_logits(hidden: torch.Tensor, lm_head: Linear | None, embed_tokens: Embedding) -> torch.Tensor:
    """``hidden`` ``[N, hidden]`` -> float32 logits ``[N, vocab]``: through ``lm_head``, or through
    the input embedding matrix when the head is tied to it (``lm_head`` is ``None``)."""
    if lm_head is None:
        return F.linear(hidden, embed_tokens.weight).float()             # (N, vocab)
    return lm_head(hidden).float()                                        # (N, vocab)
