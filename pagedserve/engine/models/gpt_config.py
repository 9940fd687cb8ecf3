"""Configs of the GELU/LayerNorm family (GPT-2, GPT-NeoX, Falcon), parsed from ``config.json``.

Older files name fields GPT-2's way (``n_embd``/``n_embed``, ``n_head``, ``n_layer``,
``n_positions``); :func:`~pagedserve.engine.models.config.require` takes a field's names in order.
No torch here (``models/config.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedserve.engine.models.config import ModelConfig, ModelConfigError, gelu_approximation, require, rope_config
from pagedserve.engine.models.rope_config import RopeConfig

_GPT2_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast", "gelu")
_GPT2_REFUSED_FLAGS = ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention")


@dataclass(frozen=True, kw_only=True)
class GPT2Config(ModelConfig):
    """GPT-2: :class:`ModelConfig` (``intermediate_size`` is ``n_inner``, default 4 x hidden;
    ``num_kv_heads == num_heads``; ``max_position_embeddings`` is ``n_positions``, the rows of
    ``wpe``) plus

    Attributes:
        layer_norm_eps (``layer_norm_epsilon``).
        gelu_approximate: ``"tanh"`` (``gelu_new``) or ``"none"`` (``gelu``).
        attention_scale: ``1/sqrt(head_dim)``, or 1 when ``scale_attn_weights`` is false.
    """

    layer_norm_eps: float
    gelu_approximate: str
    attention_scale: float


@dataclass(frozen=True, kw_only=True)
class GPTNeoXConfig(ModelConfig):
    """GPT-NeoX (``num_kv_heads == num_heads``; LayerNorms and linears have biases) plus

    Attributes:
        rotary_dim: channels of each head that are rotated (``int(head_dim * rotary_pct)``, even).
        layer_norm_eps: epsilon of every LayerNorm.
        use_parallel_residual: attention and MLP both read the block input (else sequential).
        attention_bias: ``query_key_value`` and ``dense`` have biases.
        gelu_approximate: ``"none"`` (exact erf GELU) or ``"tanh"``.
        rope: rotary settings (on ``rotary_dim`` channels).
    """

    rotary_dim: int
    layer_norm_eps: float
    use_parallel_residual: bool
    attention_bias: bool
    gelu_approximate: str
    rope: RopeConfig


@dataclass(frozen=True, kw_only=True)
class FalconConfig(ModelConfig):
    """Falcon (rotary, or ALiBi when ``alibi``) plus

    Attributes:
        layer_norm_eps: epsilon of every LayerNorm.
        new_decoder_architecture: the fused QKV is KV-grouped; the block is parallel
            (``num_kv_heads``: ``num_kv_heads``; else 1 with ``multi_query``, or ``num_heads``).
        parallel_attn: attention and MLP read the same input (else sequential, with a
            ``post_attention_layernorm``).
        num_layernorms: LayerNorms in front of a parallel block: 2 (``ln_attn``, ``ln_mlp``) or 1
            (``input_layernorm``).
        bias: the linear layers have biases (LayerNorms always do).
        gelu_approximate: ``"none"`` (exact erf GELU) or ``"tanh"``.
        rope: rotary settings; ``None`` under ALiBi.
        alibi: ALiBi position bias instead of rotary.
    """

    layer_norm_eps: float
    new_decoder_architecture: bool
    parallel_attn: bool
    num_layernorms: int
    bias: bool
    gelu_approximate: str
    rope: RopeConfig | None
    alibi: bool = False


def parse_gpt2_config(raw: dict[str, Any]) -> GPT2Config:
    """A GPT-2 ``config.json`` -> :class:`GPT2Config`.

    Raises:
        ModelConfigError: a required field is missing, ``n_embd`` is not a multiple of ``n_head``,
            an activation other than the GELUs, or a flag this model does not implement
            (``scale_attn_by_inverse_layer_idx``, ``reorder_and_upcast_attn``, ``add_cross_attention``).
    """
    for flag in _GPT2_REFUSED_FLAGS:
        if raw.get(flag):
            raise ModelConfigError(f"GPT-2 with {flag}=true is not supported")
    gelu = gelu_approximation(raw, "activation_function", "gelu_new", _GPT2_ACTIVATIONS)
    hidden, heads = int(require(raw, "n_embd")), int(require(raw, "n_head"))
    if hidden % heads:
        raise ModelConfigError(f"GPT-2 n_embd {hidden} is not a multiple of n_head {heads}")
    head_dim = hidden // heads
    return GPT2Config(
        architecture=(raw.get("architectures") or ["GPT2LMHeadModel"])[0],
        vocab_size=int(require(raw, "vocab_size")), hidden_size=hidden,
        intermediate_size=int(raw.get("n_inner") or 4 * hidden),
        num_layers=int(require(raw, "n_layer")), num_heads=heads, num_kv_heads=heads,
        head_dim=head_dim, max_position_embeddings=int(raw.get("n_positions", 1024)),
        layer_norm_eps=float(raw.get("layer_norm_epsilon", 1e-5)), gelu_approximate=gelu,
        attention_scale=head_dim ** -0.5 if raw.get("scale_attn_weights", True) else 1.0,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)))


def parse_gpt_neox_config(raw: dict[str, Any]) -> GPTNeoXConfig:
    """Builds a :class:`GPTNeoXConfig` from a parsed ``config.json`` (``rotary_pct`` and
    ``rotary_emb_base``, or transformers 5's ``rope_parameters`` with ``partial_rotary_factor``).

    Raises:
        ModelConfigError: a missing field, an unsupported activation or RoPE type, or an odd
            rotary width.
    """
    num_heads, hidden = int(require(raw, "num_attention_heads")), int(require(raw, "hidden_size"))
    head_dim = hidden // num_heads
    rope_params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    rotary_pct = float(rope_params.pop("partial_rotary_factor", raw.get("rotary_pct", 0.25)))
    rope_params.setdefault("rope_theta", raw.get("rotary_emb_base", 10000.0))
    rotary_dim = int(head_dim * rotary_pct)
    if rotary_dim % 2:
        raise ModelConfigError(f"rotary width {rotary_dim} (head_dim {head_dim} x rotary_pct {rotary_pct}) is odd")
    max_pos = int(raw.get("max_position_embeddings", 2048))
    return GPTNeoXConfig(
        architecture=raw["architectures"][0], vocab_size=int(require(raw, "vocab_size")), hidden_size=hidden,
        intermediate_size=int(raw.get("intermediate_size") or 4 * hidden),
        num_layers=int(require(raw, "num_hidden_layers")), num_heads=num_heads, num_kv_heads=num_heads,
        head_dim=head_dim, rotary_dim=rotary_dim, layer_norm_eps=float(raw.get("layer_norm_eps", 1e-5)),
        max_position_embeddings=max_pos, tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        use_parallel_residual=bool(raw.get("use_parallel_residual", True)),
        attention_bias=bool(raw.get("attention_bias", True)),
        gelu_approximate=gelu_approximation(raw, "hidden_act", "gelu"),
        rope=rope_config({"rope_parameters": rope_params}, max_pos))


def _falcon_block_layout(raw: dict[str, Any], num_heads: int) -> tuple[int, bool, int]:
    """``(num_kv_heads, parallel_attn, num_layernorms)`` as transformers' FalconDecoderLayer builds
    them. Raises ``ModelConfigError`` for combinations it cannot run either."""
    num_ln = raw.get("num_ln_in_parallel_attn")
    if raw.get("new_decoder_architecture"):
        if not raw.get("parallel_attn", True):
            raise ModelConfigError("Falcon's new_decoder_architecture needs parallel_attn: true")
        num_kv_heads = int(raw.get("num_kv_heads") or raw.get("n_head_kv") or num_heads)
        if num_heads % num_kv_heads:
            raise ModelConfigError(f"num_attention_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        return num_kv_heads, True, int(num_ln or 2)
    if num_ln == 2:
        raise ModelConfigError("num_ln_in_parallel_attn: 2 needs new_decoder_architecture: true")
    return (1 if raw.get("multi_query", True) else num_heads), bool(raw.get("parallel_attn", True)), 1


def parse_falcon_config(raw: dict[str, Any]) -> FalconConfig:
    """Builds a :class:`FalconConfig` from a parsed ``config.json`` (also the older ``n_head``,
    ``n_layer``, ``n_embed``, ``n_head_kv`` names).

    Raises:
        ModelConfigError: a missing field, an unsupported activation or RoPE type (rotary models),
            or a block layout transformers cannot build.
    """
    alibi = bool(raw.get("alibi", False))
    num_heads = int(require(raw, "num_attention_heads", "n_head"))
    hidden = int(require(raw, "hidden_size", "n_embed"))
    num_kv_heads, parallel_attn, num_layernorms = _falcon_block_layout(raw, num_heads)
    max_pos = int(raw.get("max_position_embeddings", 2048))
    return FalconConfig(
        architecture=raw["architectures"][0], vocab_size=int(require(raw, "vocab_size")), hidden_size=hidden,
        intermediate_size=int(raw.get("ffn_hidden_size") or 4 * hidden),
        num_layers=int(require(raw, "num_hidden_layers", "n_layer")), num_heads=num_heads,
        num_kv_heads=num_kv_heads, head_dim=hidden // num_heads,
        layer_norm_eps=float(raw.get("layer_norm_epsilon", 1e-5)), max_position_embeddings=max_pos,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
        new_decoder_architecture=bool(raw.get("new_decoder_architecture", False)), parallel_attn=parallel_attn,
        num_layernorms=num_layernorms, bias=bool(raw.get("bias", False)),
        gelu_approximate=gelu_approximation(raw, "activation", "gelu"),
        rope=None if alibi else rope_config(raw, max_pos), alibi=alibi)
