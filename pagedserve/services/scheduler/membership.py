"""Which workers the scheduler uses: the one owner of admitting, resetting and dropping them.

A worker is known by its id and by the instance id it registers with (new at every start of its
process). Every change of membership is logged.

- A registered worker is admitted: a connection, and a fresh block manager in the scheduler.
- A worker whose step failed (gRPC error, ``--step-timeout``, a plan it refused) is reset: its
  sequences go back to the queue to be recomputed, and it is admitted again after a back-off
  (1 s, doubling up to 30 s while it keeps failing) once it beats again: its registration shows a
  heartbeat newer than the one in the first view read after the failure. A worker that hangs
  (stopped, swapping) or died is not sent plans that can only fail again, each costing its requests
  one of their ``MAX_WORKER_LOSSES``. The baseline is read after the failure because a beat written
  between the last view and a kill -9 would look newer than anything seen before it.
  Its new session id makes it drop everything it held.
- A worker that registers with another instance id (it restarted), or that this scheduler owns
  under a new lease epoch (it was another scheduler's meanwhile), is reset at once.
- A worker whose registration is missing longer than ``gone_after_s`` is dropped; a shorter gap
  (Redis restarted empty, the worker registers again) changes nothing.
- A worker this scheduler no longer owns (it lost the worker's lease to a peer) is dropped at once:
  the worker refuses its plans now.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from pagedserve.engine.config import PreemptionMode
from pagedserve.engine.outputs import RequestOutput
from pagedserve.engine.scheduler import Scheduler
from pagedserve.services.common.pb import engine_pb2 as pb
from pagedserve.services.scheduler.commands import ClusterView
from pagedserve.services.scheduler.grpc_executor import GrpcExecutor

log = logging.getLogger("pagedserve.scheduler")

FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0


@dataclass
class _Member:
    instance_id: str
    address: str
    lease_epoch: int
    missing_since: float | None = None


@dataclass(frozen=True)
class _Backoff:
    """A reset worker waiting to be admitted again.

    Attributes:
        failed_at: when the step failure was seen, clock seconds.
        until: not admitted before then, clock seconds.
        delay_s: this back-off's length (the next failure doubles it).
        instance_id: the failed instance (another one, a restart, need not beat again).
        beat_after_failure: the failed instance's heartbeat in the first view read after
            ``failed_at`` (``None`` until such a view lists it): admitted only after a newer one.
    """

    failed_at: float
    until: float
    delay_s: float
    instance_id: str
    beat_after_failure: int | None = None


class WorkerMembership:
    """Keeps the scheduler's workers and the executor's connections in step with the registrations.

    Args:
        scheduler: the engine scheduler (its block managers are made and dropped here).
        executor: the connections to the workers.
        gone_after_s: how long a registration may be missing before the worker is dropped.
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(self, scheduler: Scheduler, executor: GrpcExecutor, gone_after_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._scheduler = scheduler
        self._executor = executor
        self._gone_after_s = gone_after_s
        self._clock = clock
        self._members: dict[str, _Member] = {}
        self._backoff: dict[str, _Backoff] = {}
        self._refused: dict[str, str] = {}  # worker id -> instance id refused (logged once)

    @property
    def worker_ids(self) -> list[str]:
        return list(self._members)

    def sync(self, view: ClusterView) -> list[RequestOutput]:
        """Admits new and restarted workers, drops those whose registration stayed missing.

        Args:
            view: the registrations of the live workers this scheduler owns and the lease epoch of
                every worker it owns (sent in every plan: the worker's fence), registered or not;
                a member without an epoch lost its lease. ``view.read_at`` is on this
                membership's clock.

        Returns:
            Final outputs of requests ended because their workers kept failing (``Scheduler.remove_worker``).
        """
        live, epochs = view.workers, view.epochs
        now, outputs = self._clock(), []
        for worker_id, member in list(self._members.items()):
            reg = live.get(worker_id)
            if worker_id not in epochs:
                outputs += self._drop(worker_id, "this scheduler no longer holds its lease")
            elif reg is None:
                member.missing_since = member.missing_since or now
                if now - member.missing_since > self._gone_after_s:
                    outputs += self._drop(worker_id, f"its registration has been missing for {self._gone_after_s:g} s")
            elif (reg.instance_id, reg.address) != (member.instance_id, member.address):
                outputs += self._drop(worker_id, f"it restarted (instance {reg.instance_id} at {reg.address})")
            elif epochs[worker_id] != member.lease_epoch:
                outputs += self._drop(worker_id, f"its lease changed hands (epoch {epochs[worker_id]})")
            else:
                member.missing_since = None
        self._note_beats_after_failures(view)
        for worker_id, reg in live.items():
            if worker_id not in self._members and self._may_admit(worker_id, reg, now):
                self._admit(reg, epochs[worker_id])
        return outputs

    def step_failed(self, worker_id: str, error: str) -> list[RequestOutput]:
        """Resets a worker whose step failed; it is admitted again after a back-off. Returns what
        ``Scheduler.remove_worker`` returns."""
        if worker_id not in self._members:
            return []
        delay = min(self._backoff[worker_id].delay_s * 2, MAX_BACKOFF_S) if worker_id in self._backoff else FIRST_BACKOFF_S
        now = self._clock()
        self._backoff[worker_id] = _Backoff(now, now + delay, delay, self._members[worker_id].instance_id)
        return self._drop(worker_id, f"a step failed ({error}); admitting it again in {delay:g} s if it is registered "
                                     "and beats again")

    def step_succeeded(self, worker_id: str) -> None:
        """A worker that answers again starts over with the shortest back-off."""
        self._backoff.pop(worker_id, None)

    def _may_admit(self, worker_id: str, reg: pb.WorkerRegistration, now: float) -> bool:
        backoff = self._backoff.get(worker_id)
        if backoff is not None and (now < backoff.until or (reg.instance_id == backoff.instance_id and (
                backoff.beat_after_failure is None or reg.heartbeat <= backoff.beat_after_failure))):
            return False
        mismatch = self._mismatch(reg)
        if mismatch is not None:
            if self._refused.get(worker_id) != reg.instance_id:
                self._refused[worker_id] = reg.instance_id
                log.error("worker %s %s: not admitted", worker_id, mismatch)
            return False
        return True

    def _note_beats_after_failures(self, view: ClusterView) -> None:
        """Keeps each failed instance's heartbeat from the first view read after its failure."""
        for worker_id, backoff in list(self._backoff.items()):
            reg = view.workers.get(worker_id)
            if (backoff.beat_after_failure is None and reg is not None and reg.instance_id == backoff.instance_id
                    and view.read_at >= backoff.failed_at):
                self._backoff[worker_id] = replace(backoff, beat_after_failure=reg.heartbeat)

    def _mismatch(self, reg: pb.WorkerRegistration) -> str | None:
        """How the worker's settings contradict the scheduler's (``None``: they agree).

        Speculative decoding: the scheduler reserves ``k`` KV slots per decode for drafts and the
        worker drafts at most its own ``k``; both must speculate alike (``num_speculative_tokens``,
        0 when off). A worker reading ``k`` from the plan alone could not tell a plan's smaller
        lookahead (``max_tokens`` near, a full token budget) from a scheduler started with another
        ``k``, and a worker without speculation would fail every plan that reserves slots.
        """
        block_size = self._scheduler.config.block_size
        if reg.block_size != block_size:
            return (f"uses block size {reg.block_size}, the scheduler {block_size}; restart it with "
                    f"--block-size {block_size}")
        k = self._scheduler.speculative.num_lookahead_tokens
        if reg.num_speculative_tokens != k:
            return (f"verifies {reg.num_speculative_tokens} draft tokens per step, the scheduler reserves slots for "
                    f"{k} (0: no speculative decoding); start both with the same --speculative-method and "
                    "--num-speculative-tokens")
        return None

    def _admit(self, reg: pb.WorkerRegistration, lease_epoch: int) -> None:
        self._executor.add_worker(reg.worker_id, reg.address, lease_epoch)
        self._scheduler.add_worker(reg.worker_id, reg.num_blocks, reg.num_cpu_blocks, reg.device)
        self._members[reg.worker_id] = _Member(reg.instance_id, reg.address, lease_epoch)
        log.info("worker %s (instance %s, lease epoch %d) at %s admitted with %d blocks (%d CPU blocks) on %s, token "
                 "budget %d; %d worker(s) now", reg.worker_id, reg.instance_id, lease_epoch, reg.address,
                 reg.num_blocks, reg.num_cpu_blocks, reg.device or "an unnamed device",
                 self._scheduler.config.token_budget(reg.device), len(self._members))
        if not reg.device and self._scheduler.config.max_num_batched_tokens is None:
            log.warning("worker %s registers no device (it is older than this scheduler): it gets a CPU's token "
                        "budget; for an older GPU worker start the scheduler with --max-num-batched-tokens 2048",
                        reg.worker_id)
        if self._scheduler.config.preemption_mode is PreemptionMode.SWAP and not reg.num_cpu_blocks:
            log.warning("worker %s has no CPU blocks: --preemption-mode swap recomputes its preempted sequences "
                        "instead; start it with --swap-space (e.g. 4GiB)", reg.worker_id)

    def _drop(self, worker_id: str, why: str) -> list[RequestOutput]:
        del self._members[worker_id]
        outputs = self._scheduler.remove_worker(worker_id)
        self._executor.remove_worker(worker_id)
        log.warning("worker %s dropped: %s; its sequences are recomputed elsewhere; %d worker(s) now",
                    worker_id, why, len(self._members))
        return outputs
