"""Per-step attention metadata: where new K/V go and which cached tokens each sequence reads.

Conventions (shared with the Triton kernels in ``pagedserve_kernels/``; PagedAttention, Kwon et al., SOSP 2023, §4):
the scheduled tokens of all sequences form one flat batch without padding; sequence ``i`` owns
tokens ``query_start_loc[i] : query_start_loc[i+1]``, which are the last ``query_len`` positions of
its ``seq_lens[i]`` context positions; the query at position ``p`` attends to keys at positions ``<= p``.

The metadata is built once per step and shared by every layer. Besides the kernel inputs it carries
CPU-side helpers the torch backend uses: the leading ``num_decode_seqs`` one-token sequences (decodes)
batched into padded gathers, and the remaining sequences described one by one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import torch


@dataclass(frozen=True)
class DecodeChunk:
    """Consecutive one-token sequences ``start..end-1`` (also their token indices), gathered together.

    Attributes:
        start, end: sequence range; these sequences sit at the front of the batch, one token each.
        padded_len: context positions gathered per sequence (a multiple of the block size).
        block_indices: int64 ``[(end - start) * padded_len / block_size]``, whole cache blocks to
            gather, sequence-major (whole blocks copy far faster than single slots); positions past
            a sequence's length come from its last block or its block-table padding and are masked.
        mask: additive ``[end - start, 1, 1, padded_len]`` in the model dtype: 0 for a key the
            sequence may read, ``-inf`` for padding.
    """

    start: int
    end: int
    padded_len: int
    block_indices: torch.Tensor
    mask: torch.Tensor


@dataclass(frozen=True)
class FreshPrefill:
    """A sequence with no cached context: its new tokens attend causally to each other only.

    Attributes:
        query_start, query_end: its token range in the flat batch.
    """

    query_start: int
    query_end: int


@dataclass(frozen=True)
class ContextPrefill:
    """A sequence whose new tokens also read cached context (chunked prefill, or a stray decode).

    Attributes:
        query_start, query_end: its token range in the flat batch.
        block_indices: int64 ``[ceil(seq_len / block_size)]``, the cache blocks holding positions
            ``0..seq_len-1`` (gathered whole; positions past ``seq_len`` are masked).
        mask: additive ``[query_len, padded_len]`` in the model dtype, causal with the query offset
            by the context length (``padded_len`` = blocks x block size).
        context_len: cached positions before the new tokens (the first new token's position).
    """

    query_start: int
    query_end: int
    block_indices: torch.Tensor
    mask: torch.Tensor
    context_len: int = 0


@dataclass(frozen=True, eq=False)
class TorchHelperInputs:
    """The step's host-side description, kept for the torch backend's helpers (``AttentionMetadata``).

    Attributes:
        table: int32 ``[num_seqs, max_blocks]`` block tables on the CPU.
        seq_lens, context_lens: per sequence, context including / before the new tokens.
        query_start_loc: ``num_seqs + 1`` cumulative new-token counts.
        dtype: the masks' dtype (the model's); device: where the helpers' tensors go.
        decode_chunk_tokens: most padded context positions gathered at once on the decode path.
    """

    table: torch.Tensor
    seq_lens: Sequence[int]
    context_lens: Sequence[int]
    query_start_loc: Sequence[int]
    dtype: torch.dtype
    device: torch.device | str
    decode_chunk_tokens: int


@dataclass(frozen=True)
class AttentionMetadata:
    """Everything attention needs for one step, shared by all layers.

    Attributes:
        slot_mapping: int64 ``[num_tokens]``, slot = ``block_id * block_size + offset`` to write each new K/V.
        block_tables: int32 ``[num_seqs, max_blocks]``, logical -> physical block; rows are padded
            with block 0 past the blocks a sequence needs.
        seq_lens: int32 ``[num_seqs]``, context length including the new tokens.
        query_start_loc: int32 ``[num_seqs + 1]``, cumulative new-token counts.
        max_query_len: longest new-token run of a sequence.
        max_seq_len: longest context.
        block_size: token slots per block.
        num_decode_seqs: the leading sequences that attend as decodes (one new token each; a one-token
            prompt remainder after them does not); the batch's first ``num_decode_seqs`` tokens are theirs.
            The CPU backends read it (the Triton backend dispatches on ``max_query_len``).
        torch_helper_inputs: what the torch backend's helpers below are built from, on first use.

    The torch backend's helpers, built when first read (once per step: every layer shares them; the C++
    and Triton backends never read them, and building them took 3.5 ms of a 256-sequence decode step):
        decode_chunks: the leading one-token sequences in chunks gathered at once (a chunk's gathered
            K/V stay in the CPU caches between gather and attention).
        fresh_prefills, context_prefills: the other sequences.
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_query_len: int
    max_seq_len: int
    block_size: int
    num_decode_seqs: int
    torch_helper_inputs: TorchHelperInputs = field(repr=False, compare=False)

    @cached_property
    def decode_chunks(self) -> tuple[DecodeChunk, ...]:
        h = self.torch_helper_inputs
        return _decode_chunks(h.table, h.seq_lens, self.num_decode_seqs, self.block_size, h.decode_chunk_tokens,
                              h.dtype, h.device)

    @cached_property
    def _prefills(self) -> tuple[tuple[FreshPrefill, ...], tuple[ContextPrefill, ...]]:
        h = self.torch_helper_inputs
        return _prefills(h.table, h.query_start_loc, h.context_lens, h.seq_lens, self.num_decode_seqs,
                         self.block_size, h.dtype, h.device)

    @property
    def fresh_prefills(self) -> tuple[FreshPrefill, ...]:
        return self._prefills[0]

    @property
    def context_prefills(self) -> tuple[ContextPrefill, ...]:
        return self._prefills[1]

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])


def compute_positions(query_lens: Sequence[int], context_lens: Sequence[int]) -> torch.Tensor:
    """Positions of the new tokens: ``context_lens[i] .. context_lens[i] + query_lens[i] - 1`` per sequence.

    Returns:
        int64 ``[sum(query_lens)]``.
    """
    q = torch.tensor(query_lens, dtype=torch.int64)                       # (S,)
    ctx = torch.tensor(context_lens, dtype=torch.int64)                   # (S,)
    starts = torch.cumsum(q, 0) - q                                       # (S,) first token of each seq
    offset = torch.repeat_interleave(ctx - starts, q)                     # (T,)
    return torch.arange(int(q.sum()), dtype=torch.int64) + offset         # (T,)


def _padded_block_tables(block_tables: Sequence[Sequence[int]], seq_lens: Sequence[int],
                         block_size: int) -> torch.Tensor:
    """The blocks each sequence needs, padded with block 0: int32 ``[S, max_blocks]``.

    Raises:
        ValueError: a sequence has fewer blocks than its context needs.
    """
    needed = [-(-n // block_size) for n in seq_lens]
    width = max(needed)
    rows = []
    for i, (table, n) in enumerate(zip(block_tables, needed)):
        if len(table) < n:
            raise ValueError(f"sequence {i} needs {n} blocks for {seq_lens[i]} tokens but has {len(table)}")
        rows.append(list(table[:n]) + [0] * (width - n))
    return torch.tensor(rows, dtype=torch.int32)


def _additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where ``allowed``, ``-inf`` elsewhere, in ``dtype``."""
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))


def _decode_chunk(table: torch.Tensor, seq_lens: Sequence[int], start: int, end: int, block_size: int,
                  dtype: torch.dtype, device: torch.device | str) -> DecodeChunk:
    """Gather indices and padding mask for one-token sequences ``start..end-1`` (rows of ``table``)."""
    lens = seq_lens[start:end]
    num_blocks = -(-max(lens) // block_size)
    padded_len = num_blocks * block_size
    blocks = table[start:end, :num_blocks].long()                         # (n, nb)
    allowed = torch.arange(padded_len)[None, :] < torch.tensor(lens)[:, None]  # (n, Lp)
    mask = _additive_mask(allowed, dtype).view(end - start, 1, 1, padded_len)  # (n, 1, 1, Lp)
    return DecodeChunk(start, end, padded_len, blocks.reshape(-1).to(device), mask.to(device))


def _decode_chunks(table: torch.Tensor, seq_lens: Sequence[int], num_decode: int, block_size: int,
                   chunk_tokens: int, dtype: torch.dtype, device: torch.device | str) -> tuple[DecodeChunk, ...]:
    """Splits the leading ``num_decode`` sequences into runs whose padded contexts total at most
    ``chunk_tokens`` (a longer single sequence gets a chunk of its own)."""
    chunks, start, longest = [], 0, 0
    for i in range(num_decode):
        padded = -(-seq_lens[i] // block_size) * block_size
        if i > start and (i - start + 1) * max(longest, padded) > chunk_tokens:
            chunks.append(_decode_chunk(table, seq_lens, start, i, block_size, dtype, device))
            start, longest = i, 0
        longest = max(longest, padded)
    if num_decode:
        chunks.append(_decode_chunk(table, seq_lens, start, num_decode, block_size, dtype, device))
    return tuple(chunks)


def _prefills(table: torch.Tensor, query_start_loc: list[int], context_lens: Sequence[int],
              seq_lens: Sequence[int], first: int, block_size: int, dtype: torch.dtype,
              device: torch.device | str) -> tuple[tuple[FreshPrefill, ...], tuple[ContextPrefill, ...]]:
    """Describes sequences ``first..`` one by one: fresh ones, and those that read cached context."""
    fresh, with_context = [], []
    for i in range(first, len(seq_lens)):
        start, end = query_start_loc[i], query_start_loc[i + 1]
        if context_lens[i] == 0:
            fresh.append(FreshPrefill(start, end))
            continue
        num_blocks = -(-seq_lens[i] // block_size)
        k_pos = torch.arange(num_blocks * block_size)                     # (Lp,)
        q_pos = torch.arange(context_lens[i], seq_lens[i])                # (q,)
        mask = _additive_mask(k_pos[None, :] <= q_pos[:, None], dtype)    # (q, Lp)
        blocks = table[i, :num_blocks].long()                             # (nb,)
        with_context.append(ContextPrefill(start, end, blocks.to(device), mask.to(device), context_lens[i]))
    return tuple(fresh), tuple(with_context)


def build_attention_metadata(
    query_lens: Sequence[int],
    context_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    positions: torch.Tensor,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    decode_chunk_tokens: int = 4096,
    num_decode_seqs: int | None = None,
) -> AttentionMetadata:
    """Builds the step's metadata from per-sequence Python lists (a loop over sequences, none over tokens).

    Args:
        query_lens: new tokens per sequence (>= 1), in batch order. Put one-token sequences first,
            sorted by context length, for the fast decode path (any order is correct).
        context_lens: tokens per sequence already in the cache.
        block_tables: per sequence, its physical block ids (may hold more than it needs).
        positions: int64 ``[sum(query_lens)]`` from :func:`compute_positions`.
        block_size: token slots per block.
        dtype: dtype of the additive masks (the model's activation dtype).
        device: where the tensors go.
        decode_chunk_tokens: most padded context positions gathered at once on the decode path.
        num_decode_seqs: the leading one-token sequences that attend as decodes (the model runner's
            ``attention_layout`` says; a one-token prompt remainder after them is not one); default:
            every leading one-token sequence.

    Raises:
        ValueError: empty batch, a query length < 1, a block table too short for its sequence, or
            ``num_decode_seqs`` counting a sequence of more than one token.
    """
    if not query_lens or min(query_lens) < 1:
        raise ValueError(f"every sequence needs >= 1 new token, got query_lens={list(query_lens)}")
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    table = _padded_block_tables(block_tables, seq_lens, block_size)      # (S, MB) int32
    q = torch.tensor(query_lens, dtype=torch.int64)                       # (S,)
    seq_idx = torch.repeat_interleave(torch.arange(len(query_lens)), q)   # (T,)
    blocks = table.long()[seq_idx, positions // block_size]               # (T,)
    slot_mapping = blocks * block_size + positions % block_size           # (T,) int64
    query_start_loc = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.cumsum(q, 0)                              # (S+1,)
    leading = next((i for i, n in enumerate(query_lens) if n != 1), len(query_lens))
    num_decode = leading if num_decode_seqs is None else num_decode_seqs
    if not 0 <= num_decode <= leading:
        raise ValueError(f"num_decode_seqs={num_decode_seqs}, but only the first {leading} sequences have one token")
    return AttentionMetadata(
        slot_mapping=slot_mapping.to(device),
        block_tables=table.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=query_start_loc.to(device),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_size=block_size,
        num_decode_seqs=num_decode,
        torch_helper_inputs=TorchHelperInputs(table, seq_lens, tuple(context_lens), query_start_loc.tolist(), dtype,
                                              device, decode_chunk_tokens),
    )
