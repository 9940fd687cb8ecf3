"""The model-config base every architecture's config extends, and the helpers their parsers share.

Everything here reads a parsed Hugging Face ``config.json`` (a ``dict``) without torch or
transformers, so the gateway can use it. Each architecture's own fields and parser live in
``llama_config.py`` (Llama, Mistral, Qwen2/3, Mixtral) and ``gpt_config.py`` (GPT-2, GPT-NeoX,
Falcon); ``registry.py`` names which parser reads which architecture.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedserve.engine.models.rope_config import RopeConfig, parse_rope_config


class ModelConfigError(ValueError):
    """``config.json`` describes a model pagedserve cannot build (missing field, unsupported
    architecture or option), or the folder has no ``config.json``."""


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """What every architecture's config holds (the engine, the KV cache and the services read these).

    Attributes:
        architecture: ``config.json["architectures"][0]``.
        vocab_size, hidden_size, intermediate_size: widths.
        num_layers: decoder layers.
        num_heads, num_kv_heads, head_dim: attention geometry (``num_heads % num_kv_heads == 0``);
            the KV cache holds ``num_layers`` x ``num_kv_heads`` x ``head_dim`` per token.
        max_position_embeddings: context length the model was configured for, in tokens.
        tie_word_embeddings: the LM head reuses the input embedding matrix.
        eos_token_ids: ``config.json``'s ``eos_token_id`` (``generation_config.json`` may override
            it: ``model_info.py``).
        sliding_window: the attention window in tokens, when the model has one (Mistral); ``None``
            otherwise. Full attention is exact only within it.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...] = ()
    sliding_window: int | None = None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def max_model_len(self) -> int:
        """The longest context served, in tokens: ``max_position_embeddings``, capped by the
        sliding window when there is one (inside it full attention is exact)."""
        if self.sliding_window is None:
            return self.max_position_embeddings
        return min(self.max_position_embeddings, self.sliding_window)


def require(raw: dict[str, Any], *keys: str) -> Any:
    """The value of the first of ``keys`` present (not null) in ``raw``: the names one field has in
    different ``config.json`` generations (``num_attention_heads``, then GPT-2's ``n_head``).

    Raises:
        ModelConfigError: none is present; the message names ``keys[0]``.
    """
    for key in keys:
        if raw.get(key) is not None:
            return raw[key]
    raise ModelConfigError(f"config.json has no {keys[0]!r}")


def token_ids(value: int | list[int] | None) -> tuple[int, ...]:
    """An ``eos_token_id`` entry (one id, a list, or absent) as a tuple of ids."""
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, list) else (int(value),)


def sliding_window(raw: dict[str, Any]) -> int | None:
    """``sliding_window`` when set and not switched off by ``use_sliding_window: false``."""
    window = raw.get("sliding_window")
    return int(window) if window and raw.get("use_sliding_window", True) else None


def rope_config(raw: dict[str, Any], max_position_embeddings: int) -> RopeConfig:
    """:func:`~pagedserve.engine.models.rope_config.parse_rope_config`, refusing with ``ModelConfigError``."""
    try:
        return parse_rope_config(raw, max_position_embeddings)
    except ValueError as exc:
        raise ModelConfigError(str(exc)) from exc


GELU_APPROXIMATIONS = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu_fast": "tanh"}


def gelu_approximation(raw: dict[str, Any], key: str, default: str,
                       supported: tuple[str, ...] = ("gelu", "gelu_new", "gelu_pytorch_tanh")) -> str:
    """The activation ``raw[key]`` (``default`` when absent) -> ``F.gelu``'s ``approximate``
    (``"none"``: exact erf GELU, or ``"tanh"``).

    Raises:
        ModelConfigError: the activation is not among ``supported``.
    """
    name = raw.get(key, default)
    if name not in supported:
        raise ModelConfigError(f"{key} {name!r} is not supported (supported: {', '.join(supported)})")
    return GELU_APPROXIMATIONS[name]
