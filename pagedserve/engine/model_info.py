"""What the services need to know about a model folder, read from its JSON files (no torch).

A model folder is a Hugging Face folder: ``config.json``, ``*.safetensors``, tokenizer files and,
optionally, ``generation_config.json``. ``config.json`` is parsed by the model registry
(``models/registry.py``), as the worker parses it, so the services accept the folders the worker can run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pagedserve.engine.models.config import token_ids
from pagedserve.engine.models.registry import load_model_config


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


def load_model_info(path: str | Path) -> ModelInfo:
    """Reads ``config.json`` (and ``generation_config.json`` when present) of a model folder.

    Raises:
        ModelConfigError: no ``config.json``, an unsupported architecture, or a config its
            architecture's parser refuses.
    """
    folder = Path(path)
    config = load_model_config(folder)
    generation_file = folder / "generation_config.json"
    generation = json.loads(generation_file.read_text()) if generation_file.is_file() else {}
    eos = token_ids(generation["eos_token_id"]) if "eos_token_id" in generation else config.eos_token_ids
    return ModelInfo(
        path=folder,
        architecture=config.architecture,
        max_model_len=config.max_model_len,
        vocab_size=config.vocab_size,
        eos_token_ids=eos,
        num_layers=config.num_layers,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
    )
