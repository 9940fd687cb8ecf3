"""The scheduler's per-iteration limits and modes, and the stats it reports."""

from __future__ import annotations

import argparse
import enum
from dataclasses import dataclass


# Paged-attention implementations a worker may be started with (make_attention_backend picks one).
ATTENTION_BACKENDS = ("auto", "cpu", "torch", "triton")


class GemmBackend(enum.Enum):
    """Which kernels run the model's linear layers on CPU (``pagedserve/engine/models/onednn.py``)."""

    TORCH = "torch"  # F.linear (MKL): the same kernels as transformers, greedy output token-identical to HF
    ONEDNN = "onednn"  # oneDNN, weights prepacked: 2-3x faster on CPU; float32 sums in another order (opt-in)


def add_gemm_backend_argument(parser: argparse.ArgumentParser) -> None:
    """``--gemm-backend`` for every command that builds a model (worker, up, benchmarks)."""
    parser.add_argument(
        "--gemm-backend", choices=[b.value for b in GemmBackend], default=GemmBackend.TORCH.value,
        help="linear layers on CPU: torch (F.linear; greedy output token-identical to transformers) or "
             "onednn (weights prepacked for oneDNN: 2-3x faster matmuls, float32 sums in another order, so "
             "greedy output can differ from transformers where two logits nearly tie) (default %(default)s)")


def add_rank_grid_arguments(parser: argparse.ArgumentParser) -> None:
    """``--tensor-parallel-size``, ``--pipeline-parallel-size`` and ``--virtual-engines`` for every
    command that builds a worker (worker, up, complete --offline)."""
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="ranks that split each layer of the model (Megatron-LM; every architecture, CPU): "
                        "rank 0 talks to the scheduler, T-1 helper processes hold the other shards; "
                        "--kv-cache-memory is per rank (default %(default)s)")
    parser.add_argument("--pipeline-parallel-size", type=int, default=1,
                        help="pipeline stages of consecutive layers (every architecture, CPU): T*P ranks, rank 0 "
                        "in stage 0; --kv-cache-memory is per rank (default %(default)s)")
    parser.add_argument("--virtual-engines", type=int, default=0,
                        help="with --pipeline-parallel-size P > 1: virtual engines, each its own worker id "
                        "<id>/ve<i> (and port), whose plans overlap in the stages; 0: P (default %(default)s)")


class CompileMode(enum.Enum):
    """How the worker runs the model's dense part (``pagedserve/engine/models/compiled.py``)."""

    EAGER = "eager"  # op by op in torch eager: greedy output token-identical to HF with --gemm-backend torch
    INDUCTOR = "inductor"  # torch.compile (inductor) fuses norms, rotary, SiLU-mul, residual adds (opt-in)


def add_compile_mode_argument(parser: argparse.ArgumentParser) -> None:
    """``--compile-mode`` for every command that builds a model (worker, up, benchmarks)."""
    parser.add_argument(
        "--compile-mode", choices=[m.value for m in CompileMode], default=CompileMode.EAGER.value,
        help="eager: run the model op by op (greedy output token-identical to transformers with "
             "--gemm-backend torch); inductor: torch.compile the layers' dense part (fused RMSNorm, "
             "rotary, SiLU*mul, residual adds; busy decode steps 4-15%% shorter on CPU, single-sequence "
             "steps slightly longer; reductions in another order; about 40 s of compiling at start) (default %(default)s)")


class PreemptionMode(enum.Enum):
    """How blocks are taken back from a running sequence when they run out (vLLM §4.5)."""

    RECOMPUTE = "recompute"  # free them; the sequence is prefilled again later
    SWAP = "swap"  # copy them to the worker's CPU blocks and back later


class SchedulingPolicy(enum.Enum):
    """The waiting queue's order and whom to preempt (``pagedserve/engine/policy.py``)."""

    FCFS = "fcfs"
    PRIORITY = "priority"


class Placement(enum.Enum):
    """Which worker a waiting sequence is admitted on (``worker_state.pick_worker``)."""

    PREFIX = "prefix"  # the most cached prompt prefix, balanced against KV usage and running sequences
    LEAST_LOADED = "least-loaded"  # the most free KV blocks


# The token budget (max_num_batched_tokens) per device kind. On a GPU a step costs about the same
# until the budget fills the device; on a CPU every token adds to the step, so a smaller budget
# keeps decodes from waiting behind long prefill chunks at no throughput cost. Measured with
# `pagedserve bench token-budget` (docs/benchmarks.md): on 2 CPU cores, 1,024-token prompts at
# 0.5 req/s, p99 inter-token latency 244 ms at 256 vs 853 ms at 2048, same output tokens/s; 64
# ShareGPT requests all at once: 393 vs 387 output tokens/s.
CPU_TOKEN_BUDGET = 256
GPU_TOKEN_BUDGET = 2048


MAX_PLANS_IN_FLIGHT = 4
"""A worker runs its plans one after another: more than a few queued plans only add latency."""


def default_token_budget(device: str) -> int:
    """``max_num_batched_tokens`` for workers on ``device`` (``cpu``, ``cuda``, ``cuda:1``, ...)."""
    return GPU_TOKEN_BUDGET if device.startswith("cuda") else CPU_TOKEN_BUDGET


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one iteration on one worker.

    Attributes:
        block_size: token slots per KV-cache block; every worker must use the same.
        max_num_seqs: most sequences running on one worker at once.
        max_num_batched_tokens: most tokens (decodes + prefill chunks) one worker computes in one
            iteration. Decodes are served first; prefill chunks fill the rest, within the time
            ``max_decode_slowdown`` leaves them. The default suits GPU workers; see
            :func:`default_token_budget` for CPU ones.
        enable_chunked_prefill: prefill prompts longer than what is left of the budget over several
            iterations; without it a prompt is prefilled whole or waits (and one longer than the
            budget is refused).
        enable_prefix_caching: share cached full blocks between requests with the same prefix.
        preemption_mode: ``recompute`` (free the blocks, prefill again later) or ``swap`` (copy
            them to the worker's CPU blocks and back; recompute when CPU blocks run out).
        policy: ``fcfs`` or ``priority`` (see pagedserve/engine/policy.py).
        max_plans_in_flight: plans a worker may have been sent and not yet answered. 1: the next
            plan is made once the worker's answer is in. 2 (overlap scheduling): the next plan is
            made while the worker runs the current one; a sequence that decodes is scheduled
            again before its new token is known, and the worker feeds that token in itself.
            Outputs are the same either way (see docs/architecture.md, "Overlap scheduling").
        placement: ``prefix`` (the worker holding the longest cached prefix of the prompt, balanced
            against load) or ``least-loaded`` (the most free blocks).
        max_decode_slowdown: with chunked prefill, a step that runs decodes takes at most this
            many times as long as its decodes alone would (predicted from the worker's step
            times): its prefill chunks are sized to fit (``pagedserve/engine/step_cost.py``).
            Bounds the inter-token latency of running requests while long prompts are prefilled;
            ``inf``: chunks fill the token budget.

    Raises:
        ValueError: a non-positive limit, more than ``MAX_PLANS_IN_FLIGHT`` plans in flight,
            a decode slowdown below 1, an unknown mode or policy.
    """

    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = GPU_TOKEN_BUDGET
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    preemption_mode: PreemptionMode = PreemptionMode.RECOMPUTE
    policy: SchedulingPolicy = SchedulingPolicy.FCFS
    max_plans_in_flight: int = 2
    placement: Placement = Placement.PREFIX
    max_decode_slowdown: float = 2.0

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_plans_in_flight"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_plans_in_flight > MAX_PLANS_IN_FLIGHT:
            raise ValueError(f"max_plans_in_flight must be at most {MAX_PLANS_IN_FLIGHT}, got {self.max_plans_in_flight}")
        if not self.max_decode_slowdown >= 1:  # NaN too
            raise ValueError(f"max_decode_slowdown must be at least 1, got {self.max_decode_slowdown}")
        # The enums' values are accepted too (flags, ``LLM(policy="priority")``).
        object.__setattr__(self, "preemption_mode", PreemptionMode(self.preemption_mode))
        object.__setattr__(self, "policy", SchedulingPolicy(self.policy))
        object.__setattr__(self, "placement", Placement(self.placement))


@dataclass(frozen=True)
class WorkerStats:
    """KV-cache occupancy of one worker, in blocks."""

    worker_id: str
    num_blocks: int
    num_free_blocks: int
    num_running: int
    num_swapped: int = 0
    num_cached_blocks: int = 0


@dataclass(frozen=True)
class SchedulerStats:
    """A snapshot of the scheduler's queues."""

    num_waiting: int
    num_running: int
    num_preemptions: int
    num_steps: int
    workers: tuple[WorkerStats, ...]
    num_swapped: int = 0
    num_swap_preemptions: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up
    prefix_cache_hits: int = 0  # of which found cached
