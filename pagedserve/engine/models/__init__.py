"""Model classes and the registry from ``config.json["architectures"][0]`` to a class."""

from __future__ import annotations

from types import MappingProxyType
from collections.abc import Mapping

from torch import nn

from pagedserve.engine.models.config import ModelConfig, ModelConfigError, load_model_config, parse_model_config
from pagedserve.engine.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM

MODEL_CLASSES: Mapping[str, type[nn.Module]] = MappingProxyType({
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
})


class UnsupportedArchitectureError(ModelConfigError):
    """``config.json`` names an architecture without a model class here."""


def model_class_for(architecture: str) -> type[nn.Module]:
    """The model class for an architecture name.

    Raises:
        UnsupportedArchitectureError: no class is registered for it.
    """
    try:
        return MODEL_CLASSES[architecture]
    except KeyError:
        raise UnsupportedArchitectureError(
            f"architecture {architecture!r} is not supported; supported: {', '.join(sorted(MODEL_CLASSES))}"
        ) from None


__all__ = [
    "MODEL_CLASSES",
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "ModelConfig",
    "ModelConfigError",
    "Qwen2ForCausalLM",
    "UnsupportedArchitectureError",
    "load_model_config",
    "model_class_for",
    "parse_model_config",
]
