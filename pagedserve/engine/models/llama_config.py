"""Configs of the Llama family (Llama, Mistral, Qwen2, Qwen3, Mixtral), parsed from ``config.json``.

Both RoPE formats are read: transformers >= 5 writes ``rope_parameters`` (holding ``rope_theta``
and ``rope_type``); older files carry ``rope_theta`` and ``rope_scaling`` (``type`` or
``rope_type``). No torch here (``models/config.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedserve.engine.models.config import ModelConfig, ModelConfigError, require, rope_config
from pagedserve.engine.models.rope_config import RopeConfig


@dataclass(frozen=True, kw_only=True)
class LlamaConfig(ModelConfig):
    """A decoder-only Llama-family transformer: :class:`ModelConfig` plus

    Attributes:
        rms_norm_eps: epsilon of every RMSNorm.
        qkv_bias: q/k/v projections have biases (Qwen2; Llama's ``attention_bias``).
        o_bias: the output projection has a bias (Llama's ``attention_bias``).
        mlp_bias: gate/up/down projections have biases.
        rope: rotary position embedding settings.
    """

    rms_norm_eps: float
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    rope: RopeConfig


@dataclass(frozen=True, kw_only=True)
class MixtralConfig(LlamaConfig):
    """:class:`LlamaConfig` plus the mixture of experts.

    Attributes:
        num_local_experts: experts per layer (8 in Mixtral 8x7B).
        num_experts_per_tok: experts each token is routed to (top-k, 2).
    """

    num_local_experts: int
    num_experts_per_tok: int


def _llama_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """The :class:`LlamaConfig` fields of ``raw`` as keywords, biases by Llama's rule
    (``attention_bias`` on q/k/v and o; ``mlp_bias``).

    Raises:
        ModelConfigError: a required field is missing, ``hidden_act`` is not SiLU, the head counts
            do not divide, or the RoPE settings are unsupported.
    """
    act = raw.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ModelConfigError(f"hidden_act {act!r} is not supported (only silu)")
    num_heads = int(require(raw, "num_attention_heads"))
    num_kv_heads = int(raw.get("num_key_value_heads") or num_heads)
    if num_heads % num_kv_heads:
        raise ModelConfigError(
            f"num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}")
    hidden = int(require(raw, "hidden_size"))
    max_pos = int(raw.get("max_position_embeddings", 2048))
    attention_bias = bool(raw.get("attention_bias", False))
    return dict(
        architecture=require(raw, "architectures")[0],
        vocab_size=int(require(raw, "vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(require(raw, "intermediate_size")),
        num_layers=int(require(raw, "num_hidden_layers")),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=int(raw.get("head_dim") or hidden // num_heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=attention_bias,
        o_bias=attention_bias,
        mlp_bias=bool(raw.get("mlp_bias", False)),
        rope=rope_config(raw, max_pos),
    )


def parse_llama_config(raw: dict[str, Any]) -> LlamaConfig:
    """A Llama or Mistral ``config.json`` -> :class:`LlamaConfig`. Raises ``ModelConfigError``
    (see :func:`_llama_fields`)."""
    return LlamaConfig(**_llama_fields(raw))


def parse_qwen2_config(raw: dict[str, Any]) -> LlamaConfig:
    """A Qwen2 ``config.json`` -> :class:`LlamaConfig`: q/k/v always have biases, o never.
    Raises ``ModelConfigError``."""
    return LlamaConfig(**{**_llama_fields(raw), "qkv_bias": True, "o_bias": False})


def parse_qwen3_config(raw: dict[str, Any]) -> LlamaConfig:
    """A Qwen3 ``config.json`` -> :class:`LlamaConfig` (``attention_bias`` biases q/k/v and o
    alike, Llama's rule).

    Raises:
        ModelConfigError: what :func:`parse_llama_config` refuses, or no explicit ``head_dim``.
    """
    if not raw.get("head_dim"):
        raise ModelConfigError("Qwen3 config.json has no 'head_dim' (Qwen3 sets it explicitly)")
    return parse_llama_config(raw)


def parse_mixtral_config(raw: dict[str, Any]) -> MixtralConfig:
    """The Llama-family fields (no projection biases in Mixtral) plus the expert counts.

    Raises:
        ModelConfigError: what :func:`parse_llama_config` refuses, a missing expert count, or
            ``num_experts_per_tok`` outside ``1..num_local_experts``.
    """
    fields = {**_llama_fields(raw), "qkv_bias": False, "o_bias": False, "mlp_bias": False}
    experts, top_k = int(require(raw, "num_local_experts")), int(raw.get("num_experts_per_tok", 2))
    if not 1 <= top_k <= experts:
        raise ModelConfigError(f"num_experts_per_tok {top_k} must be in 1..num_local_experts ({experts})")
    return MixtralConfig(**fields, num_local_experts=experts, num_experts_per_tok=top_k)
