"""Rotary position embedding settings, one frozen dataclass per scaling type.

Parsed from either ``config.json`` format: ``rope_parameters`` (transformers >= 5: ``rope_type``,
``rope_theta`` and the type's fields in one dict) or the older top-level ``rope_theta`` plus a
``rope_scaling`` dict keyed by ``type`` or ``rope_type``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Union


@dataclass(frozen=True)
class DefaultRope:
    """Plain RoPE (Su et al., 2021, "RoFormer"): ``inv_freq[j] = theta ** (-2j / head_dim)``."""

    theta: float


@dataclass(frozen=True)
class LinearRope:
    """Position interpolation (Chen et al., 2023): every frequency divided by ``factor``."""

    theta: float
    factor: float


@dataclass(frozen=True)
class DynamicNTKRope:
    """Dynamic NTK scaling: past ``max_position_embeddings`` the base grows with the sequence length."""

    theta: float
    factor: float
    max_position_embeddings: int


@dataclass(frozen=True)
class Llama3Rope:
    """Llama 3.1 frequency-dependent scaling: low frequencies divided by ``factor``, high ones kept,
    a smooth blend in between."""

    theta: float
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class YarnRope:
    """YaRN (Peng et al., 2023): per-dimension blend of interpolated and extrapolated frequencies,
    and cos/sin scaled by ``attention_factor``."""

    theta: float
    factor: float
    original_max_position_embeddings: int
    beta_fast: float
    beta_slow: float
    attention_factor: float
    truncate: bool


RopeConfig = Union[DefaultRope, LinearRope, DynamicNTKRope, Llama3Rope, YarnRope]


def _yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(params: dict[str, Any], theta: float, max_pos: int) -> YarnRope:
    original = int(params.get("original_max_position_embeddings") or max_pos)
    factor = params.get("factor")
    factor = float(factor) if factor is not None else max_pos / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor, 1.0)
    return YarnRope(
        theta=theta,
        factor=factor,
        original_max_position_embeddings=original,
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        attention_factor=float(attention_factor),
        truncate=bool(params.get("truncate", True)),
    )


def _rope_dict(raw: dict[str, Any]) -> dict[str, Any]:
    """The RoPE fields of either format as one dict with ``rope_type`` and ``rope_theta``."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def parse_rope_config(raw: dict[str, Any], max_position_embeddings: int) -> RopeConfig:
    """The RoPE settings of a ``config.json`` dict.

    Raises:
        ValueError: an unsupported ``rope_type``, a missing field of a scaling type, or a
            ``partial_rotary_factor`` other than 1.
    """
    params = _rope_dict(raw)
    if float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor") or 1.0)) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported")
    kind, theta = params["rope_type"], float(params["rope_theta"])
    try:
        if kind == "default":
            return DefaultRope(theta)
        if kind == "linear":
            return LinearRope(theta, float(params["factor"]))
        if kind == "dynamic":
            return DynamicNTKRope(theta, float(params["factor"]), max_position_embeddings)
        if kind == "llama3":
            return Llama3Rope(theta, float(params["factor"]), float(params["low_freq_factor"]),
                              float(params["high_freq_factor"]),
                              int(params.get("original_max_position_embeddings") or max_position_embeddings))
        if kind == "yarn":
            return _yarn(params, theta, max_position_embeddings)
    except KeyError as exc:
        raise ValueError(f"rope_type {kind!r} needs the field {exc.args[0]!r}") from exc
    raise ValueError(f"rope_type {kind!r} is not supported (default, linear, dynamic, llama3, yarn)")
