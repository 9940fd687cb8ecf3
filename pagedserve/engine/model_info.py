"""What the services need to know about a model folder, read from its JSON files (no torch).

A model folder is a Hugging Face folder: ``config.json``, ``*.safetensors``, tokenizer files and,
optionally, ``generation_config.json``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM", "Qwen2ForCausalLM",
                           "Qwen3ForCausalLM", "GPT2LMHeadModel", "GPTNeoXForCausalLM", "FalconForCausalLM")
# config.json names of the same fact: the Llama-style name first, then GPT-2's (and older Falcon files').
_ALIASES = {"max_position_embeddings": ("n_positions",), "num_attention_heads": ("n_head",),
            "num_hidden_layers": ("n_layer",), "hidden_size": ("n_embd", "n_embed")}


class ModelFolderError(ValueError):
    """The folder is not a usable model folder (missing files, unsupported architecture)."""


@dataclass(frozen=True)
class ModelInfo:
    """Facts about a model that the gateway, scheduler and worker share.

    Attributes:
        path: the model folder.
        architecture: ``config.json["architectures"][0]``.
        max_model_len: context length in tokens (capped by a sliding window when the model has one).
        vocab_size: number of token ids.
        eos_token_ids: ids that end generation, from ``generation_config.json`` (else ``config.json``).
        num_layers, num_kv_heads, head_dim: KV-cache geometry.
    """

    path: Path
    architecture: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    num_layers: int
    num_kv_heads: int
    head_dim: int

    @property
    def name(self) -> str:
        return self.path.name

    def kv_bytes_per_block(self, block_size: int, dtype_size: int) -> int:
        """Bytes of K and V for one block across all layers."""
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * dtype_size


def _as_tuple(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)


def _field(config: dict, key: str, default: object = None) -> object:
    """``config[key]``, or the first of its aliases present (GPT-2's ``n_head`` ...), else ``default``."""
    for name in (key, *_ALIASES.get(key, ())):
        if config.get(name) is not None:
            return config[name]
    if default is None:
        raise ModelFolderError(f"config.json has no {key!r}")
    return default


def _falcon_kv_heads(config: dict, num_heads: int) -> int:
    """Falcon's KV heads: grouped (new decoder architecture), one (multi-query) or one per head."""
    if config.get("new_decoder_architecture"):
        return int(config.get("num_kv_heads") or config.get("n_head_kv") or num_heads)
    return 1 if config.get("multi_query", True) else num_heads


def load_model_info(path: str | Path) -> ModelInfo:
    """Reads ``config.json`` (and ``generation_config.json`` when present) of a model folder.

    Raises:
        ModelFolderError: no ``config.json``, or an architecture pagedserve cannot run.
    """
    folder = Path(path)
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ModelFolderError(f"{folder} has no config.json; --model takes a Hugging Face model folder")
    config = json.loads(config_file.read_text())
    architectures = config.get("architectures") or []
    if not architectures or architectures[0] not in SUPPORTED_ARCHITECTURES:
        raise ModelFolderError(
            f"{folder}: architecture {architectures} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    generation_file = folder / "generation_config.json"
    generation = json.loads(generation_file.read_text()) if generation_file.is_file() else {}
    eos = _as_tuple(generation.get("eos_token_id", config.get("eos_token_id")))
    max_len = int(_field(config, "max_position_embeddings", 2048))
    window = config.get("sliding_window")
    if window and config.get("use_sliding_window", True):
        max_len = min(max_len, int(window))  # full attention is exact only within the window
    num_heads = int(_field(config, "num_attention_heads"))
    kv_heads = (_falcon_kv_heads(config, num_heads) if architectures[0] == "FalconForCausalLM"
                else int(config.get("num_key_value_heads") or num_heads))
    return ModelInfo(
        path=folder,
        architecture=architectures[0],
        max_model_len=max_len,
        vocab_size=int(config["vocab_size"]),
        eos_token_ids=eos,
        num_layers=int(_field(config, "num_hidden_layers")),
        num_kv_heads=kv_heads,
        head_dim=int(config.get("head_dim") or int(_field(config, "hidden_size")) // num_heads),
    )
