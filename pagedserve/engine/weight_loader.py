"""Loads Hugging Face ``*.safetensors`` checkpoints into our model classes.

Checkpoint names map to ours by dropping the ``model.`` prefix; ``q_proj``/``k_proj``/``v_proj``
and ``gate_proj``/``up_proj`` land in row ranges of the fused ``qkv_proj`` and ``gate_up_proj``
(the model's ``fused_shards()``). Every parameter row must be filled exactly once and every
checkpoint tensor used, else :class:`WeightLoadError` names what is missing or left over.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from pagedserve.engine.models.registry import load_model_config, model_class_for

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some older checkpoints saved


class WeightLoadError(ValueError):
    """A checkpoint does not fit the model: missing, unexpected, duplicate or mis-shaped tensors."""


def safetensors_files(folder: str | Path) -> list[Path]:
    """The checkpoint files of a folder: those of ``model.safetensors.index.json`` when present,
    else every ``*.safetensors``.

    Raises:
        WeightLoadError: no safetensors file.
    """
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [folder / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise WeightLoadError(f"{folder} holds no *.safetensors file")
    return files


def iter_checkpoint(folder: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields ``(name, tensor)`` for every tensor of the folder's safetensors files (CPU, stored dtype)."""
    for path in safetensors_files(folder):
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)


def _module_of(param_name: str) -> str:
    """``layers.0.self_attn.qkv_proj.weight`` -> ``qkv_proj``; ``norm.weight`` -> ``norm``."""
    return param_name.rsplit(".", 2)[-2]


def _target(name: str, fused: dict[str, dict[str, tuple[int, int]]]) -> tuple[str, str, tuple[int, int] | None]:
    """For a checkpoint tensor: our parameter name, the checkpoint module filling it (the shard), and
    the row range it fills (``None``: the whole parameter)."""
    name = name.removeprefix("model.")
    module_path, _, leaf = name.rpartition(".")
    parent, _, module = module_path.rpartition(".")
    for fused_module, shards in fused.items():
        if module in shards:
            return f"{parent}.{fused_module}.{leaf}", module, shards[module]
    return name, module, None


def load_weights(model: nn.Module, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copies checkpoint tensors into ``model``'s parameters (converting dtype and device).

    Args:
        model: one of our model classes (it provides ``fused_shards()`` and ``config``).
        tensors: ``(checkpoint name, tensor)`` pairs, e.g. from :func:`iter_checkpoint`.

    Raises:
        WeightLoadError: a parameter (or fused shard) left unfilled, a tensor the model has no
            place for, a tensor given twice, or a shape mismatch.
    """
    params = dict(model.named_parameters())
    fused = model.fused_shards()
    tied = model.config.tie_word_embeddings
    filled: dict[str, set[str]] = {name: set() for name in params}
    unexpected: list[str] = []
    for name, tensor in tensors:
        if name.endswith(_IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
            continue  # a buffer, or a saved copy of the tied embedding matrix
        param_name, shard, rows = _target(name, fused)
        if param_name not in params:
            unexpected.append(name)
            continue
        target = params[param_name].data if rows is None else params[param_name].data.narrow(0, *rows)
        if tuple(target.shape) != tuple(tensor.shape):
            raise WeightLoadError(f"{name} has shape {tuple(tensor.shape)}; {param_name} expects {tuple(target.shape)}")
        if shard in filled[param_name]:
            raise WeightLoadError(f"{name} appears twice in the checkpoint")
        if rows is None:  # take the loaded storage itself: no second copy of a large matrix
            params[param_name].data = tensor.to(dtype=target.dtype, device=target.device).contiguous()
        else:
            target.copy_(tensor)
        filled[param_name].add(shard)
    _check_complete(filled, fused, unexpected)


def _check_complete(filled: dict[str, set[str]], fused: dict[str, dict[str, tuple[int, int]]],
                    unexpected: list[str]) -> None:
    """Raises :class:`WeightLoadError` for unfilled parameters/shards or unused tensors."""
    missing = []
    for param_name, shards in filled.items():
        module = _module_of(param_name)
        if module in fused:
            missing += [f"{param_name} ({s})" for s in sorted(set(fused[module]) - shards)]
        elif not shards:
            missing.append(param_name)
    problems = []
    if missing:
        problems.append(f"the checkpoint lacks tensors for: {', '.join(missing)}")
    if unexpected:
        problems.append(f"the model has no parameter for checkpoint tensors: {', '.join(unexpected)}")
    if problems:
        raise WeightLoadError("; ".join(problems))


def load_model(folder: str | Path, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu") -> nn.Module:
    """Builds the model class named by ``folder/config.json`` and loads its safetensors weights.

    Raises:
        ModelConfigError: unreadable config or unsupported architecture
            (``UnsupportedArchitectureError`` for the latter).
        WeightLoadError: the checkpoint does not fit the model.
    """
    config = load_model_config(folder)
    model = model_class_for(config.architecture)(config, dtype=dtype, device=device)
    model.load_checkpoint(iter_checkpoint(folder))
    return model.eval()
