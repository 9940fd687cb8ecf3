"""Megatron-LM sharding (Shoeybi et al., 2019, §3) of every supported architecture, read shard by shard.

Rank ``r`` of ``T`` holds:

* column-parallel attention input: its ``H/T`` query heads and its KV heads. KV heads are split
  (``Hkv/T`` each) when ``Hkv >= T``, else replicated: rank ``r`` keeps KV head ``r * Hkv // T``,
  the one its query heads attend with (as vLLM does). Per checkpoint layout: Llama's separate
  ``q_proj``/``k_proj``/``v_proj`` rows; the fused ``query_key_value`` of GPT-NeoX and Falcon,
  grouped by KV head (``[Hkv, H/Hkv + 2, D]`` rows: GPT-NeoX and Falcon's original layout are
  ``[H, 3, D]``, multi-query ``[q; k; v]`` is one group), read as whole groups or, replicated, as
  the rank's query rows of its group plus that group's k and v (:func:`grouped_qkv_slice`);
  GPT-2's ``c_attn`` Conv1D ``[hidden, q|k|v]``: the rank's columns of q, of k and of v;
* column-parallel MLP input (gate/up, ``dense_h_to_4h``, ``c_fc``, each expert's w1/w3): ``I/T``;
* row-parallel outputs (``o_proj``, ``down_proj``, ``dense``, ``dense_4h_to_h``, ``c_proj``, each
  expert's w2): the matching ``H*D/T`` / ``I/T`` input columns (rows of a Conv1D); their partial
  outputs are summed by an all-reduce; a bias is held by rank 0 only, zeros elsewhere, so it is
  added once;
* vocabulary-parallel embedding and LM head: rows ``[r*Vr, (r+1)*Vr)`` with ``Vr = ceil(V/T)``,
  the last shard padded with zero rows;
* everything else whole: norms, Qwen3's per-head-dim QK-norm, Mixtral's router, GPT-2's learned
  positions.

Each model class says which of these a checkpoint tensor is (its ``checkpoint_slice``), with the
helpers here. Peak memory while loading, per rank: its share of the model plus one checkpoint
slice (at most one tensor's rows for this rank; a norm vector whole). ``safetensors``'
``get_slice`` reads only those bytes, so no rank ever materialises a whole projection or the whole
embedding matrix.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from pagedserve.engine.weight_loader import safetensors_files


class ShardingError(ValueError):
    """The model cannot be split over this many ranks (heads or widths do not divide)."""


@dataclass(frozen=True)
class ShardLayout:
    """What rank ``rank`` of ``world_size`` holds (see the module docstring).

    Attributes:
        num_heads, num_kv_heads: this rank's query / KV heads.
        kv_head_start: first KV head (of the checkpoint's) this rank holds.
        intermediate_size: this rank's MLP width (of each expert, for Mixtral).
        vocab_per_rank: ``ceil(V/T)`` embedding / LM-head rows per rank (padded).
        head_dim, vocab_size, total_heads, total_kv_heads: unsplit.
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
    total_heads: int = 0
    total_kv_heads: int = 0

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_per_rank

    @property
    def head_start(self) -> int:
        """The checkpoint index of this rank's first query head."""
        return self.rank * self.num_heads

    def local_config(self, config):
        """``config`` with this rank's head counts and MLP width (vocab size left whole)."""
        return dataclasses.replace(config, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                                   intermediate_size=self.intermediate_size)


def _split_problem(config, t: int) -> str | None:
    """Why ``config`` cannot be split over ``t`` ranks, or ``None``."""
    heads, kv_heads, width = config.num_heads, config.num_kv_heads, config.intermediate_size
    if heads % t:
        return f"its {heads} attention heads do not divide by {t}"
    if width % t:
        return f"its MLP width {width} does not divide by {t}"
    if kv_heads >= t and kv_heads % t:
        return f"its {kv_heads} KV heads cannot be split over {t} ranks"
    if kv_heads < t and t % kv_heads:
        return f"its {kv_heads} KV heads cannot be replicated over {t} ranks"
    return None


def tensor_parallel_sizes(config) -> list[int]:
    """The tensor-parallel sizes ``config`` splits over (1 always does)."""
    return [t for t in range(1, config.num_heads + 1) if _split_problem(config, t) is None]


def shard_layout(config, rank: int, world_size: int) -> ShardLayout:
    """The layout of rank ``rank`` for a model config (any architecture's: it has ``num_heads``,
    ``num_kv_heads``, ``head_dim``, ``intermediate_size`` and ``vocab_size``).

    Raises:
        ShardingError: ``H % T``, ``I % T`` or (``Hkv % T`` when ``Hkv >= T``, else ``T % Hkv``) is
            not 0; the message lists the sizes that work.
    """
    t = world_size
    problem = _split_problem(config, t) if t >= 1 else "it is below 1"
    if problem is not None:
        sizes = ", ".join(map(str, tensor_parallel_sizes(config)))
        raise ShardingError(f"{config.architecture} cannot run with tensor_parallel_size {t}: {problem}; "
                            f"tensor_parallel_size {sizes} work for this model")
    kv_heads = config.num_kv_heads
    local_kv = max(kv_heads // t, 1)
    kv_start = rank * local_kv if kv_heads >= t else rank * kv_heads // t
    return ShardLayout(rank, t, config.num_heads // t, local_kv, kv_start, config.intermediate_size // t,
                       -(-config.vocab_size // t), config.head_dim, config.vocab_size, config.num_heads, kv_heads)


@dataclass(frozen=True)
class Slice:
    """The part of a checkpoint tensor a rank holds: along ``dim``, the index ranges ``ranges``
    (``[(start, stop), ...]``, concatenated in order), zero-padded to ``size``; ``zeros``: the rank
    holds zeros of the tensor's shape (a row-parallel bias off rank 0)."""

    dim: int
    ranges: tuple[tuple[int, int], ...]
    size: int
    zeros: bool = False

    @property
    def start(self) -> int:
        return self.ranges[0][0]

    @property
    def stop(self) -> int:
        return self.ranges[-1][1]


ZEROS = Slice(0, (), 0, zeros=True)


def span(dim: int, start: int, stop: int, size: int | None = None) -> Slice:
    """Indices ``[start, stop)`` along ``dim`` (padded to ``size`` if given)."""
    return Slice(dim, ((start, stop),), stop - start if size is None else size)


def rank_part(layout: ShardLayout, width: int, dim: int = 0) -> Slice:
    """The rank's ``width`` indices along ``dim``: ``[r*width, (r+1)*width)`` (column-parallel rows,
    row-parallel input columns)."""
    return span(dim, layout.rank * width, (layout.rank + 1) * width)


def row_parallel(layout: ShardLayout, leaf: str, width: int, dim: int = 1) -> Slice | None:
    """A row-parallel layer's tensor: of the weight, the rank's ``width`` input indices along ``dim``
    (1 for ``[out, in]``, 0 for a Conv1D's ``[in, out]``); the bias whole on rank 0 and zeros on the
    others, so that the all-reduce adds it once."""
    if leaf == "bias":
        return None if layout.rank == 0 else ZEROS
    return rank_part(layout, width, dim)


def vocab_rows(layout: ShardLayout) -> Slice:
    """The rank's embedding / LM-head rows (the last shard padded with zero rows)."""
    v, r = layout.vocab_per_rank, layout.rank
    return span(0, min(r * v, layout.vocab_size), min((r + 1) * v, layout.vocab_size), v)


def grouped_qkv_slice(layout: ShardLayout) -> Slice:
    """The rank's rows of a fused QKV grouped by KV head, ``[Hkv, H/Hkv + 2, D]`` (GPT-NeoX,
    Falcon), in the same grouped layout with the rank's counts: whole groups when the KV heads are
    split; replicated, the rank's query rows of its group then the group's k and v rows."""
    d, group = layout.head_dim, layout.total_heads // layout.total_kv_heads
    block = (group + 2) * d  # rows of one KV head's group
    g = layout.kv_head_start
    if layout.total_kv_heads >= layout.world_size:
        return span(0, g * block, (g + layout.num_kv_heads) * block)
    first_q = layout.head_start - g * group                           # the rank's first query head in its group
    q = (g * block + first_q * d, g * block + (first_q + layout.num_heads) * d)
    kv = (g * block + group * d, (g + 1) * block)
    return Slice(0, (q, kv), (layout.num_heads + 2) * d)


def llama_checkpoint_slice(name: str, layout: ShardLayout) -> Slice | None:
    """The part of Llama-family checkpoint tensor ``name`` rank ``layout.rank`` holds; ``None``: all
    of it (also Qwen3's, whose ``q_norm``/``k_norm`` are whole, and Mixtral's dense part)."""
    parts = name.removeprefix("model.").split(".")
    module, leaf = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", parts[-1])
    d = layout.head_dim
    q_width = layout.num_heads * d
    if module == "q_proj":
        return rank_part(layout, q_width)
    if module in ("k_proj", "v_proj"):
        start = layout.kv_head_start * d
        return span(0, start, start + layout.num_kv_heads * d)
    if module in ("gate_proj", "up_proj"):
        return rank_part(layout, layout.intermediate_size)
    if module in ("o_proj", "down_proj"):
        return row_parallel(layout, leaf, q_width if module == "o_proj" else layout.intermediate_size)
    if module in ("embed_tokens", "lm_head"):
        return vocab_rows(layout)
    return None


checkpoint_slice = llama_checkpoint_slice  # the name the Llama tests and tools know


def read_slice(handle, name: str, piece: Slice | None) -> torch.Tensor:
    """Reads only ``piece`` of tensor ``name`` from an open safetensors file (float32 zeros for a
    ``zeros`` piece; the loader converts)."""
    if piece is None:
        return handle.get_tensor(name)
    view = handle.get_slice(name)
    shape = list(view.get_shape())
    if piece.zeros:
        return torch.zeros(shape)
    lead = (slice(None),) * piece.dim
    parts = (view[(*lead, slice(start, stop))] for start, stop in piece.ranges)  # each read when needed
    part = next(parts)
    if len(piece.ranges) > 1:  # one tensor filled range by range
        shape[piece.dim] = sum(stop - start for start, stop in piece.ranges)
        # a Conv1D's columns (GPT-2's q|k|v) column-major: the loader's transpose is then contiguous
        whole = (torch.empty(shape[::-1], dtype=part.dtype).t() if piece.dim == 1 and len(shape) == 2
                 else torch.empty(shape, dtype=part.dtype))
        at = 0
        for (start, stop), read in zip(piece.ranges, itertools.chain((part,), parts)):
            whole.narrow(piece.dim, at, stop - start).copy_(read)
            at += stop - start
        part = whole
    missing = piece.size - part.shape[piece.dim]
    if missing > 0:  # the last vocabulary shard: zero rows past the vocabulary
        pad_shape = list(part.shape)
        pad_shape[piece.dim] = missing
        part = torch.cat((part, part.new_zeros(pad_shape)), dim=piece.dim)
    return part


SliceOf = Callable[[str], "Slice | None"]
Rename = Callable[[str], "str | None"]


def iter_checkpoint_parts(folder: str | Path, slice_of: SliceOf | None = None,
                          rename: Rename | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields ``(name, tensor)`` for the folder's safetensors tensors, one in memory at a time (CPU,
    stored dtype): with ``rename`` (a pipeline stage's: ``None`` for a tensor the stage does not
    hold, which is not read), only the tensors it keeps, under its names; with ``slice_of``, only
    this rank's part of each."""
    for path in safetensors_files(folder):
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            for name in handle.keys():
                local = name if rename is None else rename(name)
                if local is not None:
                    yield local, read_slice(handle, name, None if slice_of is None else slice_of(name))


def iter_sharded_checkpoint(folder: str | Path, slice_of: SliceOf) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields ``(name, this rank's slice)`` for every tensor of the folder's safetensors files;
    ``slice_of``: the model's ``checkpoint_slice``."""
    return iter_checkpoint_parts(folder, slice_of)
