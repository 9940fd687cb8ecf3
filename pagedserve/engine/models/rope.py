"""Rotary position embedding (RoPE; Su et al., 2021, "RoFormer", §3.4) with the Llama-family scalings.

Rotation convention of the Hugging Face Llama checkpoints ("rotate half"): channel ``j`` of the
first half of a head pairs with channel ``j + head_dim/2``, and the pair turns by the angle
``position * inv_freq[j]``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from pagedserve.engine.models.rope_config import DynamicNTKRope, LinearRope, Llama3Rope, RopeConfig, YarnRope


def _base_inv_freq(theta: float | torch.Tensor, head_dim: int) -> torch.Tensor:
    """``1 / theta ** (2j / head_dim)`` for ``j < head_dim/2``: float32 ``[head_dim/2]`` (or ``[T, head_dim/2]``
    when ``theta`` is a ``[T, 1]`` tensor)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim  # (D/2,)
    return 1.0 / (theta ** exponents)


def _llama3_inv_freq(rope: Llama3Rope, head_dim: int) -> torch.Tensor:
    """Llama 3.1 scaling: wavelengths above ``original/low_freq_factor`` slowed by ``factor``,
    below ``original/high_freq_factor`` kept, linearly blended (in 1/wavelength) in between."""
    inv_freq = _base_inv_freq(rope.theta, head_dim)                       # (D/2,)
    wavelen = 2 * math.pi / inv_freq                                      # (D/2,)
    old = rope.original_max_position_embeddings
    scaled = torch.where(wavelen > old / rope.low_freq_factor, inv_freq / rope.factor, inv_freq)  # (D/2,)
    smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)  # (D/2,)
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled       # (D/2,)
    medium = (wavelen >= old / rope.high_freq_factor) & (wavelen <= old / rope.low_freq_factor)  # (D/2,)
    return torch.where(medium, blended, scaled)                           # (D/2,)


def _yarn_correction_dim(num_rotations: float, head_dim: int, theta: float, max_pos: int) -> float:
    """The dimension whose wavelength makes ``num_rotations`` turns over ``max_pos`` positions."""
    return head_dim * math.log(max_pos / (num_rotations * 2 * math.pi)) / (2 * math.log(theta))


def _yarn_inv_freq(rope: YarnRope, head_dim: int) -> torch.Tensor:
    """YaRN (Peng et al., 2023, §3.2 "NTK-by-parts"): extrapolate fast dimensions, interpolate slow ones."""
    old = rope.original_max_position_embeddings
    low = _yarn_correction_dim(rope.beta_fast, head_dim, rope.theta, old)
    high = _yarn_correction_dim(rope.beta_slow, head_dim, rope.theta, old)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    pos_freqs = rope.theta ** (torch.arange(0, head_dim, 2).float() / head_dim)  # (D/2,)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)  # (D/2,)
    extrapolation = 1 - ramp                                              # (D/2,) weight of 1/pos_freqs
    return (1.0 / (rope.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Inverse frequencies (radians per position) of a RoPE config: float32 ``[head_dim/2]``.

    For dynamic NTK these are the frequencies within ``max_position_embeddings``.
    """
    if isinstance(rope, LinearRope):
        return _base_inv_freq(rope.theta, head_dim) / rope.factor
    if isinstance(rope, Llama3Rope):
        return _llama3_inv_freq(rope, head_dim)
    if isinstance(rope, YarnRope):
        return _yarn_inv_freq(rope, head_dim)
    return _base_inv_freq(rope.theta, head_dim)


class RotaryEmbedding(nn.Module):
    """cos/sin of the rotation angles for a batch of positions (Su et al., 2021).

    Angles are ``position * inv_freq`` in float32 (like the reference implementation), times YaRN's
    attention factor. Dynamic NTK past ``max_position_embeddings`` gives each position the base of a
    sequence ending there, which is what incremental decoding with a KV cache sees.

    Args:
        rope: the scaling settings.
        head_dim: channels per head (even).
    """

    def __init__(self, rope: RopeConfig, head_dim: int) -> None:
        super().__init__()
        self.rope = rope
        self.head_dim = head_dim
        self.attention_factor = rope.attention_factor if isinstance(rope, YarnRope) else 1.0
        self.register_buffer("inv_freq", rope_inv_freq(rope, head_dim), persistent=False)  # (D/2,)

    def _angles(self, positions: torch.Tensor) -> torch.Tensor:
        """Rotation angles, float32 ``[T, head_dim/2]``."""
        pos = positions.to(torch.float32)[:, None]                        # (T, 1)
        angles = pos * self.inv_freq[None, :]                             # (T, D/2)
        rope = self.rope
        if isinstance(rope, DynamicNTKRope) and bool((positions >= rope.max_position_embeddings).any()):
            angles = torch.where(pos >= rope.max_position_embeddings, pos * self._ntk_inv_freq(positions), angles)
        return angles

    def _ntk_inv_freq(self, positions: torch.Tensor) -> torch.Tensor:
        """Dynamic NTK: each position uses the base for a sequence ending at it, float32 ``[T, D/2]``."""
        rope = self.rope
        seq_len = (positions.to(torch.float64) + 1).clamp(min=rope.max_position_embeddings)  # (T,)
        growth = rope.factor * seq_len / rope.max_position_embeddings - (rope.factor - 1)     # (T,)
        base = rope.theta * growth ** (self.head_dim / (self.head_dim - 2))                   # (T,)
        return _base_inv_freq(base.to(torch.float32)[:, None], self.head_dim).to(self.inv_freq.device)  # (T, D/2)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)``, each ``[T, 1, head_dim/2]`` in ``dtype``, for int64 ``positions`` ``[T]``."""
        angles = self._angles(positions)                                  # (T, D/2)
        cos = (angles.cos() * self.attention_factor).to(dtype)[:, None, :]  # (T, 1, D/2)
        sin = (angles.sin() * self.attention_factor).to(dtype)[:, None, :]  # (T, 1, D/2)
        return cos, sin
