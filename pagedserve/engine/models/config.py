"""Our own model configuration, parsed from a Hugging Face ``config.json`` (no transformers classes).

Both config formats are read: transformers >= 5 writes ``rope_parameters`` (holding ``rope_theta``
and ``rope_type``); older files carry ``rope_theta`` and ``rope_scaling`` (``type`` or ``rope_type``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedserve.engine.models.rope_config import RopeConfig, parse_rope_config


class ModelConfigError(ValueError):
    """``config.json`` describes a model this worker cannot build (missing field, unsupported option)."""


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only Llama-family transformer.

    Attributes:
        architecture: ``config.json["architectures"][0]``.
        vocab_size, hidden_size, intermediate_size: widths.
        num_layers: decoder layers.
        num_heads, num_kv_heads, head_dim: attention geometry (``num_heads % num_kv_heads == 0``).
        rms_norm_eps: epsilon of every RMSNorm.
        max_position_embeddings: context length the model was configured for, in tokens.
        tie_word_embeddings: the LM head reuses the input embedding matrix.
        qkv_bias: q/k/v projections have biases (Qwen2; Llama's ``attention_bias``).
        o_bias: the output projection has a bias (Llama's ``attention_bias``).
        mlp_bias: gate/up/down projections have biases.
        rope: rotary position embedding settings.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    rope: RopeConfig

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def _require(raw: dict[str, Any], key: str) -> Any:
    if key not in raw:
        raise ModelConfigError(f"config.json has no {key!r}")
    return raw[key]


def parse_model_config(raw: dict[str, Any]) -> ModelConfig:
    """Builds a :class:`ModelConfig` from the parsed JSON of a ``config.json``.

    Raises:
        ModelConfigError: a required field is missing, ``hidden_act`` is not SiLU, the head counts
            do not divide, or the RoPE settings are unsupported.
    """
    architectures = raw.get("architectures") or []
    if not architectures:
        raise ModelConfigError("config.json has no 'architectures' entry")
    architecture = architectures[0]
    act = raw.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ModelConfigError(f"hidden_act {act!r} is not supported (only silu)")
    num_heads = int(_require(raw, "num_attention_heads"))
    num_kv_heads = int(raw.get("num_key_value_heads") or num_heads)
    if num_heads % num_kv_heads:
        raise ModelConfigError(
            f"num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}")
    hidden = int(_require(raw, "hidden_size"))
    head_dim = int(raw.get("head_dim") or hidden // num_heads)
    max_pos = int(raw.get("max_position_embeddings", 2048))
    is_qwen2 = architecture == "Qwen2ForCausalLM"
    attention_bias = bool(raw.get("attention_bias", False))
    try:
        rope = parse_rope_config(raw, max_pos)
    except ValueError as exc:
        raise ModelConfigError(str(exc)) from exc
    return ModelConfig(
        architecture=architecture,
        vocab_size=int(_require(raw, "vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(_require(raw, "intermediate_size")),
        num_layers=int(_require(raw, "num_hidden_layers")),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=is_qwen2 or attention_bias,
        o_bias=attention_bias and not is_qwen2,
        mlp_bias=bool(raw.get("mlp_bias", False)),
        rope=rope,
    )
