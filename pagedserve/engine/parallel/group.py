"""A tensor-parallel process group over ``torch.distributed`` (gloo on CPU; NCCL on CUDA later).

Every rank of one worker joins one group through a TCP rendezvous (``tcp://127.0.0.1:PORT`` on
one machine). The collectives are the ones Megatron-LM's sharding needs (Shoeybi et al., 2019,
§3): ``all_reduce`` after each row-parallel layer, ``all_gather`` of the vocabulary shards of the
logits, and ``broadcast_object`` to hand each BatchPlan from rank 0 to the others. Collectives time
out after ``timeout_s`` (a dead peer makes them raise, they never hang for ever).

Pipeline parallelism adds ``send``/``recv`` of activations between stages on the same group and,
with T > 1, one subgroup per stage for its tensor-parallel collectives (:meth:`subgroups`).

One group per process: it is the default ``torch.distributed`` group, destroyed by :meth:`close`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

import torch
import torch.distributed as dist


class CollectiveError(RuntimeError):
    """A collective failed: a peer rank died, or did not answer within the group's timeout."""


COLLECTIVE_TIMEOUT_S = 15.0
"""How long a collective waits for a silent (hung, not dead) rank before raising, seconds: a dead
rank's closed connection fails it at once. 5 s was exceeded by a live rank of a TP2xPP2 engine on
a 2-core machine running the test suite (load 7.6), failing the worker."""


@dataclass(frozen=True)
class GroupSpec:
    """Where and how the ranks of one worker meet (picklable: handed to the helper processes).

    Attributes:
        init_method: rendezvous address, e.g. ``tcp://127.0.0.1:29500``.
        world_size: number of ranks (the tensor-parallel size T).
        timeout_s: seconds after which a collective with a silent peer raises.
        backend: ``gloo`` (CPU) or ``nccl`` (CUDA).
    """

    init_method: str
    world_size: int
    timeout_s: float = COLLECTIVE_TIMEOUT_S
    backend: str = "gloo"


def serve_rendezvous(spec: GroupSpec) -> tuple[GroupSpec, dist.TCPStore]:
    """Rank 0's rendezvous store, served from now on (before any helper starts), and the spec the
    other ranks join with: ``spec`` with the port the store holds (``spec``'s port 0: one the OS
    picks). A port found free, closed and bound again later could be taken in between (EADDRINUSE:
    seen in a test run beside other stacks).

    Raises:
        CollectiveError: the port is in use.
    """
    address = urlsplit(spec.init_method)
    with _store_errors(spec):
        store = dist.TCPStore(address.hostname, address.port, spec.world_size, is_master=True,
                              timeout=timedelta(seconds=spec.timeout_s), wait_for_workers=False)
    return replace(spec, init_method=f"tcp://{address.hostname}:{store.port}"), store


def dial_rendezvous(spec: GroupSpec) -> dist.TCPStore:
    """A client of the rendezvous store another process serves at ``spec.init_method``, retrying
    until ``spec.timeout_s``.

    Raises:
        CollectiveError: no server answered in time.
    """
    address = urlsplit(spec.init_method)
    with _store_errors(spec):
        return dist.TCPStore(address.hostname, address.port, spec.world_size,
                             timeout=timedelta(seconds=spec.timeout_s))


@contextmanager
def _store_errors(spec: GroupSpec) -> Iterator[None]:
    try:
        yield
    except (RuntimeError, ValueError) as exc:  # DistNetworkError: EADDRINUSE, connection timeouts
        raise CollectiveError(f"rendezvous {spec.init_method}: {exc}") from exc


class Collectives:
    """The collectives over a set of ranks: the whole group, or a subgroup (one pipeline stage's
    tensor-parallel ranks). ``rank`` and ``world_size`` are within the set; ``global_ranks[i]`` is
    the group rank of its member ``i``."""

    def __init__(self, rank: int, world_size: int, global_ranks: tuple[int, ...],
                 process_group: Any = None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.global_ranks = global_ranks
        self.process_group = process_group  # None: the default (whole) group

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sums ``tensor`` (any shape, e.g. ``[T, hidden]``) over the ranks, in place; returns it."""
        if self.world_size > 1:
            self._run(dist.all_reduce, tensor, group=self.process_group)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenates every rank's ``tensor`` (same shape on all ranks) along ``dim``, rank order:
        ``[N, V/T]`` shards -> ``[N, V]``."""
        if self.world_size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self._run(dist.all_gather, parts, tensor.contiguous(), group=self.process_group)
        return torch.cat(parts, dim=dim)

    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        """Member ``src`` sends ``obj`` (picklable); every member returns it."""
        if self.world_size == 1:
            return obj
        box = [obj if self.rank == src else None]
        self._run(dist.broadcast_object_list, box, src=self.global_ranks[src], group=self.process_group)
        return box[0]

    def _run(self, op, *args, **kwargs) -> None:
        try:
            op(*args, **kwargs)
        except (RuntimeError, ValueError) as exc:  # gloo: "Connection closed by peer", timeouts
            raise CollectiveError(f"rank {self.rank}: {op.__name__} failed: {exc}") from exc


class TensorParallelGroup(Collectives):
    """This process's rank in the group of all ranks of one worker (the default process group):
    the tensor-parallel group when there is one pipeline stage, else the T x P grid.

    Args:
        spec: the rendezvous.
        rank: this process's rank, ``0 <= rank < spec.world_size``.
        store: the rendezvous store, when this process already opened it (:func:`serve_rendezvous`,
            :func:`dial_rendezvous`); by default rank 0 serves it and the others dial it.

    Raises:
        CollectiveError: the other ranks did not join within the timeout.
    """

    def __init__(self, spec: GroupSpec, rank: int, store: dist.TCPStore | None = None) -> None:
        if not 0 <= rank < spec.world_size:
            raise ValueError(f"rank {rank} is outside a group of {spec.world_size}")
        super().__init__(rank, spec.world_size, tuple(range(spec.world_size)))
        self.spec = spec
        if store is None:
            store = serve_rendezvous(spec)[1] if rank == 0 else dial_rendezvous(spec)
        self.store = store
        try:
            dist.init_process_group(spec.backend, store=self.store, rank=rank, world_size=spec.world_size,
                                    timeout=timedelta(seconds=spec.timeout_s))
        except (RuntimeError, ValueError) as exc:
            _forget_failed_init()
            raise CollectiveError(f"rank {rank} could not join {spec.init_method}: {exc}") from exc

    def subgroups(self, partition: list[tuple[int, ...]]) -> Collectives:
        """Makes one subgroup per tuple of ``partition`` (every rank must call this with the same
        partition, in the same order: ``dist.new_group`` is collective) and returns this rank's."""
        mine = None
        for ranks in partition:
            handle = dist.new_group(list(ranks), timeout=timedelta(seconds=self.spec.timeout_s))
            if self.rank in ranks:
                mine = Collectives(ranks.index(self.rank), len(ranks), ranks, handle)
        if mine is None:
            raise ValueError(f"rank {self.rank} is in none of the subgroups {partition}")
        return mine

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        """Sends ``tensor`` (any shape, e.g. activations ``[T, hidden]``) to group rank ``dst``."""
        self._run(dist.send, tensor.contiguous(), dst)

    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """Receives into ``tensor`` (the shape and dtype ``src`` sends) from group rank ``src``; returns it."""
        self._run(dist.recv, tensor, src)
        return tensor

    def close(self) -> None:
        """Leaves the group (destroys the default process group); idempotent."""
        if dist.is_initialized():
            dist.destroy_process_group()


def _forget_failed_init() -> None:
    """Resets torch's count of process groups after a failed ``init_process_group``. torch names the
    default group after that process-wide count, bumped before the rendezvous can fail and reset only
    by ``destroy_process_group``: this process's next group would be named "1" while fresh helper
    ranks name theirs "0", and gloo's keys (which hold the name) would never meet (every later
    parallel engine of the process timed out: seen in a test run)."""
    if not dist.is_initialized():
        dist.distributed_c10d._world.group_count = 0
