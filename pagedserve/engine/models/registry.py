"""The one model registry: architecture names -> their config parser and model module (no torch).

``config.json["architectures"][0]`` names the architecture. Its line here gives the parser of its
``config.json`` (``llama_config.py``, ``gpt_config.py``) and the module under
``pagedserve.engine.models`` that defines the model class, whose name is the architecture's own
(as vLLM V1's registry: one line per architecture, the class imported only when a model is built).
The gateway and scheduler read configs through this module without importing torch; the worker
builds the class from the same line, so they accept the same folders.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from pagedserve.engine.models.config import ModelConfig, ModelConfigError, sliding_window, token_ids
from pagedserve.engine.models.gpt_config import parse_falcon_config, parse_gpt2_config, parse_gpt_neox_config
from pagedserve.engine.models.llama_config import (parse_llama_config, parse_mixtral_config, parse_qwen2_config,
                                                   parse_qwen3_config)


@dataclass(frozen=True)
class Architecture:
    """How to read and build one architecture.

    Attributes:
        parse_config: the parsed ``config.json`` -> the model's config (``ModelConfigError`` when
            it describes something the class cannot build).
        module: the module of ``pagedserve.engine.models`` defining the model class, which is
            named as the architecture and called as ``cls(config, dtype=, device=)``.
    """

    parse_config: Callable[[dict[str, Any]], ModelConfig]
    module: str


ARCHITECTURES: Mapping[str, Architecture] = MappingProxyType({
    "LlamaForCausalLM": Architecture(parse_llama_config, "llama"),
    "MistralForCausalLM": Architecture(parse_llama_config, "llama"),
    "MixtralForCausalLM": Architecture(parse_mixtral_config, "mixtral"),
    "Qwen2ForCausalLM": Architecture(parse_qwen2_config, "llama"),
    "Qwen3ForCausalLM": Architecture(parse_qwen3_config, "qwen3"),
    "GPT2LMHeadModel": Architecture(parse_gpt2_config, "gpt2"),
    "GPTNeoXForCausalLM": Architecture(parse_gpt_neox_config, "gpt_neox"),
    "FalconForCausalLM": Architecture(parse_falcon_config, "falcon"),
})


class UnsupportedArchitectureError(ModelConfigError):
    """``config.json`` names an architecture that has no line in :data:`ARCHITECTURES`."""


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


def model_class_for(architecture: str) -> type:
    """The model class (a torch ``nn.Module``) of a registered architecture; imports its module.

    Raises:
        UnsupportedArchitectureError: no such architecture.
    """
    module = importlib.import_module(f"pagedserve.engine.models.{architecture_for(architecture).module}")
    return getattr(module, architecture)


def parse_config(raw: dict[str, Any]) -> ModelConfig:
    """The config of the architecture ``raw["architectures"][0]`` names, parsed by its parser,
    with the fields every architecture reads alike (``eos_token_id``, ``sliding_window``).

    Raises:
        ModelConfigError: no architecture named, an unsupported one, or its parser refuses ``raw``.
    """
    architectures = raw.get("architectures") or []
    if not architectures:
        raise ModelConfigError("config.json has no 'architectures' entry")
    config = architecture_for(architectures[0]).parse_config(raw)
    return dataclasses.replace(config, eos_token_ids=token_ids(raw.get("eos_token_id")),
                               sliding_window=sliding_window(raw))


def load_model_config(folder: str | Path) -> ModelConfig:
    """Reads and parses ``folder/config.json`` with its architecture's parser.

    Raises:
        ModelConfigError: the file is missing or describes an unsupported model.
    """
    path = Path(folder) / "config.json"
    if not Path(folder).is_dir():
        raise ModelConfigError(f"{Path(folder)} is not a folder; --model takes a Hugging Face model folder "
                               "(without --model: the default model, built on first use)")
    if not path.is_file():
        raise ModelConfigError(f"{Path(folder)} has no config.json; --model takes a Hugging Face model folder")
    return parse_config(json.loads(path.read_text()))
