"""Model classes, and the registry from ``config.json["architectures"][0]`` to how to build one.

Each architecture lives in its own module and registers an :class:`Architecture` here: a parser
from the parsed ``config.json`` to its (frozen) config, and a model class. What the engine needs of
a model (see :class:`CausalLM`) is the same for all of them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Protocol

import torch
from torch import nn

from pagedserve.engine.models.config import ModelConfig, ModelConfigError, parse_model_config
from pagedserve.engine.models.gpt2 import GPT2LMHeadModel, parse_gpt2_config
from pagedserve.engine.models.falcon import FalconForCausalLM, parse_falcon_config
from pagedserve.engine.models.gpt_neox import GPTNeoXForCausalLM, parse_gpt_neox_config
from pagedserve.engine.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM
from pagedserve.engine.models.mixtral import MixtralConfig, MixtralForCausalLM, parse_mixtral_config
from pagedserve.engine.models.qwen3 import Qwen3ForCausalLM, parse_qwen3_config


class CausalLM(Protocol):
    """What the engine uses of a model (``ModelRunner``, the KV cache's sizing, the loader).

    ``config`` has at least ``architecture``, ``vocab_size``, ``num_layers``, ``num_kv_heads`` and
    ``head_dim`` (the KV cache holds ``num_layers`` x ``num_kv_heads`` x ``head_dim`` per token).
    """

    config: Any
    dtype: torch.dtype

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: Callable) -> torch.Tensor:
        """int64 ``[T]`` ids and positions -> hidden states ``[T, hidden]``; ``attention`` is the
        step's paged attention (``models/llama.py``'s ``PagedAttentionFn``)."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden]`` -> float32 logits ``[N, vocab]``."""

    def load_checkpoint(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Fills the parameters from ``(checkpoint name, tensor)`` pairs (``WeightLoadError`` when
        they do not fit)."""


@dataclass(frozen=True)
class Architecture:
    """How to build one architecture.

    Attributes:
        parse_config: the parsed ``config.json`` -> the model's config (``ModelConfigError`` when
            it describes something the class cannot build).
        model_class: called as ``model_class(config, dtype=, device=)``; a :class:`CausalLM`.
    """

    parse_config: Callable[[dict[str, Any]], Any]
    model_class: type[nn.Module]


ARCHITECTURES: Mapping[str, Architecture] = MappingProxyType({
    "LlamaForCausalLM": Architecture(parse_model_config, LlamaForCausalLM),
    "MistralForCausalLM": Architecture(parse_model_config, MistralForCausalLM),
    "MixtralForCausalLM": Architecture(parse_mixtral_config, MixtralForCausalLM),
    "Qwen2ForCausalLM": Architecture(parse_model_config, Qwen2ForCausalLM),
    "Qwen3ForCausalLM": Architecture(parse_qwen3_config, Qwen3ForCausalLM),
    "GPT2LMHeadModel": Architecture(parse_gpt2_config, GPT2LMHeadModel),
    "GPTNeoXForCausalLM": Architecture(parse_gpt_neox_config, GPTNeoXForCausalLM),
    "FalconForCausalLM": Architecture(parse_falcon_config, FalconForCausalLM),
})
MODEL_CLASSES: Mapping[str, type[nn.Module]] = MappingProxyType({k: a.model_class for k, a in ARCHITECTURES.items()})


class UnsupportedArchitectureError(ModelConfigError):
    """``config.json`` names an architecture without a model class here."""


def architecture_for(name: str) -> Architecture:
    """The registered architecture called ``name``.

    Raises:
        UnsupportedArchitectureError: none is; the message lists the supported ones.
    """
    try:
        return ARCHITECTURES[name]
    except KeyError:
        raise UnsupportedArchitectureError(
            f"architecture {name!r} is not supported; supported: {', '.join(sorted(ARCHITECTURES))}"
        ) from None


def model_class_for(architecture: str) -> type[nn.Module]:
    """The model class for an architecture name. Raises ``UnsupportedArchitectureError``."""
    return architecture_for(architecture).model_class


def parse_config(raw: dict[str, Any]) -> Any:
    """The config of the architecture ``raw["architectures"][0]`` names, parsed by its parser.

    Raises:
        ModelConfigError: no architecture named, an unsupported one, or its parser refuses ``raw``.
    """
    architectures = raw.get("architectures") or []
    if not architectures:
        raise ModelConfigError("config.json has no 'architectures' entry")
    return architecture_for(architectures[0]).parse_config(raw)


def load_model_config(folder: str | Path) -> Any:
    """Reads and parses ``folder/config.json`` with its architecture's parser.

    Raises:
        ModelConfigError: the file is missing or describes an unsupported model.
    """
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ModelConfigError(f"{Path(folder)} has no config.json")
    return parse_config(json.loads(path.read_text()))


__all__ = [
    "ARCHITECTURES",
    "Architecture",
    "CausalLM",
    "GPT2LMHeadModel",
    "FalconForCausalLM",
    "GPTNeoXForCausalLM",
    "MODEL_CLASSES",
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "MixtralConfig",
    "MixtralForCausalLM",
    "ModelConfig",
    "ModelConfigError",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "UnsupportedArchitectureError",
    "architecture_for",
    "load_model_config",
    "model_class_for",
    "parse_config",
    "parse_model_config",
]
