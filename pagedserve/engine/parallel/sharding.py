"""Megatron-LM sharding of a Llama-family checkpoint (Shoeybi et al., 2019, §3), read shard by shard.

Rank ``r`` of ``T`` holds:

* column-parallel ``qkv_proj``: its ``H/T`` query heads' rows and its KV heads' rows. KV heads are
  split (``Hkv/T`` each) when ``Hkv >= T``, else replicated: rank ``r`` keeps KV head
  ``r * Hkv // T``, the one its query heads attend with (as vLLM does);
* column-parallel ``gate_up_proj``: its ``I/T`` rows of gate and of up;
* row-parallel ``o_proj`` / ``down_proj``: the matching ``H*D/T`` / ``I/T`` input columns (their
  partial outputs are summed by one all-reduce each; a bias is held by rank 0 only, zeros elsewhere);
* vocabulary-parallel ``embed_tokens`` and ``lm_head``: rows ``[r*Vr, (r+1)*Vr)`` with
  ``Vr = ceil(V/T)``, the last shard padded with zero rows;
* everything else (norms) whole.

Peak memory while loading, per rank: its share of the model plus one checkpoint slice (at most one
tensor's rows for this rank; a norm vector whole). ``safetensors``' ``get_slice`` reads only those
bytes, so no rank ever materialises a whole projection or the whole embedding matrix.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open


class ShardingError(ValueError):
    """The model cannot be split over this many ranks (heads or widths do not divide)."""


@dataclass(frozen=True)
class ShardLayout:
    """What rank ``rank`` of ``world_size`` holds (see the module docstring).

    Attributes:
        num_heads, num_kv_heads: this rank's query / KV heads.
        kv_head_start: first KV head (of the checkpoint's) this rank holds.
        intermediate_size: this rank's MLP width.
        vocab_per_rank: ``ceil(V/T)`` embedding / LM-head rows per rank (padded).
        head_dim, vocab_size: unsplit.
    """

    rank: int
    world_size: int
    num_heads: int
    num_kv_heads: int
    kv_head_start: int
    intermediate_size: int
    vocab_per_rank: int
    head_dim: int
    vocab_size: int

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_per_rank

    def local_config(self, config):
        """``config`` with this rank's head counts and MLP width (vocab size left whole)."""
        return dataclasses.replace(config, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                                   intermediate_size=self.intermediate_size)


def shard_layout(config, rank: int, world_size: int) -> ShardLayout:
    """The layout of rank ``rank`` for a :class:`~pagedserve.engine.models.config.ModelConfig`.

    Raises:
        ShardingError: ``H % T``, ``I % T`` or (``Hkv % T`` when ``Hkv >= T``, else ``T % Hkv``) is not 0.
    """
    heads, kv_heads, t = config.num_heads, config.num_kv_heads, world_size
    if heads % t or config.intermediate_size % t:
        raise ShardingError(f"{heads} attention heads and intermediate size {config.intermediate_size} "
                            f"must both divide by tensor_parallel_size {t}")
    if (kv_heads >= t and kv_heads % t) or (kv_heads < t and t % kv_heads):
        raise ShardingError(f"{kv_heads} KV heads cannot be split or replicated over {t} ranks")
    local_kv = max(kv_heads // t, 1)
    kv_start = rank * local_kv if kv_heads >= t else rank * kv_heads // t
    return ShardLayout(rank, t, heads // t, local_kv, kv_start, config.intermediate_size // t,
                       -(-config.vocab_size // t), config.head_dim, config.vocab_size)


@dataclass(frozen=True)
class Slice:
    """Rows (``dim=0``) or columns (``dim=1``) ``[start, stop)`` of a checkpoint tensor, zero-padded
    to ``size`` along ``dim``; ``zeros``: the rank holds zeros of the tensor's shape (a row-parallel
    bias off rank 0)."""

    dim: int
    start: int
    stop: int
    size: int
    zeros: bool = False


def checkpoint_slice(name: str, layout: ShardLayout) -> Slice | None:
    """The part of checkpoint tensor ``name`` rank ``layout.rank`` holds; ``None``: all of it."""
    parts = name.removeprefix("model.").split(".")
    module, leaf = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", parts[-1])
    d, r = layout.head_dim, layout.rank
    q_width = layout.num_heads * d
    kv_width = layout.num_kv_heads * d
    width = layout.intermediate_size
    if module == "q_proj":
        return Slice(0, r * q_width, (r + 1) * q_width, q_width)
    if module in ("k_proj", "v_proj"):
        start = layout.kv_head_start * d
        return Slice(0, start, start + kv_width, kv_width)
    if module in ("gate_proj", "up_proj"):
        return Slice(0, r * width, (r + 1) * width, width)
    if module in ("o_proj", "down_proj"):
        cols = q_width if module == "o_proj" else width
        if leaf == "bias":
            return Slice(0, 0, 0, 0, zeros=r > 0) if r > 0 else None
        return Slice(1, r * cols, (r + 1) * cols, cols)
    if module in ("embed_tokens", "lm_head"):
        v = layout.vocab_per_rank
        return Slice(0, min(r * v, layout.vocab_size), min((r + 1) * v, layout.vocab_size), v)
    return None


def _read(handle, name: str, piece: Slice | None) -> torch.Tensor:
    """Reads only ``piece`` of tensor ``name`` from an open safetensors file."""
    if piece is None:
        return handle.get_tensor(name)
    view = handle.get_slice(name)
    shape = list(view.get_shape())
    if piece.zeros:
        return torch.zeros(shape)  # float32; the loader converts
    part = view[piece.start:piece.stop] if piece.dim == 0 else view[:, piece.start:piece.stop]
    missing = piece.size - part.shape[piece.dim]
    if missing > 0:  # the last vocabulary shard: zero rows past the vocabulary
        pad_shape = list(part.shape)
        pad_shape[piece.dim] = missing
        part = torch.cat((part, part.new_zeros(pad_shape)), dim=piece.dim)
    return part


def iter_sharded_checkpoint(folder: str | Path, layout: ShardLayout) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields ``(name, this rank's slice)`` for every tensor of the folder's safetensors files,
    one slice in memory at a time (CPU, stored dtype; zero-filled bias shards float32)."""
    from pagedserve.engine.weight_loader import safetensors_files

    for path in safetensors_files(folder):
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            for name in handle.keys():
                yield name, _read(handle, name, checkpoint_slice(name, layout))
