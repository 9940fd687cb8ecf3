"""Loading checkpoints whose names and fused-QKV layouts differ from ours (GPT-NeoX, Falcon).

A model gives a ``rename`` (checkpoint name -> our parameter name, or ``None`` for a tensor to
skip, e.g. a saved causal-mask buffer) and the row order of its fused ``query_key_value`` matrix;
:func:`load_renamed` copies every tensor into its parameter, re-laying out the fused QKV rows into
ours, ``[q (H*D); k (Hkv*D); v (Hkv*D)]`` (the layout ``llama.py``'s attention splits at run time),
so the forward pass never permutes. Every parameter must be filled exactly once and every tensor
used, else ``WeightLoadError`` says what is missing, left over, given twice or mis-shaped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from pagedserve.engine.weight_loader import WeightLoadError

Rename = Callable[[str], "str | None"]


def grouped_qkv_order(num_heads: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """Row permutation from a KV-grouped fused QKV matrix to ours.

    The checkpoint's rows are ``[Hkv, H/Hkv + 2, D]``: for each KV head, its ``H/Hkv`` query heads,
    then its key, then its value (Falcon's ``new_decoder_architecture``). With ``Hkv == H`` this is
    the head-interleaved ``[H, 3, D]`` layout (per head q, k, v) of GPT-NeoX and of Falcon without
    ``multi_query``.

    Returns:
        int64 ``[(H + 2*Hkv) * D]``: ``ours = theirs[order]`` (rows).
    """
    group = num_heads // num_kv_heads
    rows = torch.arange((num_heads + 2 * num_kv_heads) * head_dim).view(num_kv_heads, group + 2, head_dim)
    q = rows[:, :group].reshape(-1)                                       # (H*D,) head h = kv*group + j
    k = rows[:, group].reshape(-1)                                        # (Hkv*D,)
    v = rows[:, group + 1].reshape(-1)                                    # (Hkv*D,)
    return torch.cat((q, k, v))                                           # ((H+2Hkv)*D,)


def load_renamed(model: nn.Module, tensors: Iterable[tuple[str, torch.Tensor]], rename: Rename,
                 row_orders: dict[str, torch.Tensor]) -> None:
    """Copies checkpoint tensors into ``model``'s parameters (converting dtype and device).

    Args:
        model: the model to fill.
        tensors: ``(checkpoint name, tensor)`` pairs, e.g. from ``weight_loader.iter_checkpoint``.
        rename: checkpoint name -> our parameter name (``None``: not a weight, skipped).
        row_orders: our module name suffix (``"qkv_proj"``) -> the row permutation applied to that
            module's weight ``[rows, in]`` and bias ``[rows]`` (``ours = theirs[order]``).

    Raises:
        WeightLoadError: a parameter left unfilled, a tensor the model has no place for, a tensor
            given twice, or a shape mismatch.
    """
    params = dict(model.named_parameters())
    filled: set[str] = set()
    unexpected: list[str] = []
    for name, tensor in tensors:
        ours = rename(name)
        if ours is None:
            continue
        if ours not in params:
            unexpected.append(name)
            continue
        target = params[ours]
        if tuple(target.shape) != tuple(tensor.shape):
            raise WeightLoadError(f"{name} has shape {tuple(tensor.shape)}; {ours} expects {tuple(target.shape)}")
        if ours in filled:
            raise WeightLoadError(f"{name} appears twice in the checkpoint (as {ours})")
        module = ours.rsplit(".", 2)[-2] if "." in ours else ""
        if module in row_orders:
            tensor = tensor.index_select(0, row_orders[module])           # (rows, ...) in our layout
        target.data = tensor.to(dtype=target.dtype, device=target.device).contiguous()
        filled.add(ours)
    problems = []
    missing = sorted(set(params) - filled)
    if missing:
        problems.append(f"the checkpoint lacks tensors for: {', '.join(missing)}")
    if unexpected:
        problems.append(f"the model has no parameter for checkpoint tensors: {', '.join(unexpected)}")
    if problems:
        raise WeightLoadError("; ".join(problems))
