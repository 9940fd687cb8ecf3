"""The scheduler's per-iteration limits and modes, and the stats it reports."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from pagedserve.engine.spec_decode.counters import SpecDecodeCounters
from pagedserve.options import option


# Paged-attention implementations a worker may be started with (make_attention_backend picks one).
ATTENTION_BACKENDS = ("auto", "cpu", "torch", "triton")


class GemmBackend(enum.Enum):
    """Which kernels run the model's linear layers on CPU (``pagedserve/engine/models/onednn.py``)."""

    AUTO = "auto"  # PANELS or ONEDNN on a CPU, else TORCH (models/onednn.resolve_gemm_backend)
    TORCH = "torch"  # F.linear (MKL on CPU): the same kernels as transformers, the reference path
    ONEDNN = "onednn"  # oneDNN, weights prepacked: 2-3x faster on CPU, rows independent of the batch
    PANELS = "panels"  # float32 layers on pagedserve's AVX2 GEMM (models/panel_gemm.py), others on oneDNN


class CompileMode(enum.Enum):
    """How the worker runs the model's dense part (``pagedserve/engine/models/compiled.py``)."""

    EAGER = "eager"  # op by op in torch eager
    INDUCTOR = "inductor"  # torch.compile (inductor) fuses norms, rotary, SiLU-mul, residual adds (opt-in)


class KVCacheDtype(enum.Enum):
    """What the paged KV cache stores K and V in (vLLM's ``--kv-cache-dtype``); attention reads them
    back as float32 (``pagedserve/engine/kv_cache.py`` maps each to a torch dtype)."""

    AUTO = "auto"  # the model's dtype (--dtype)
    BFLOAT16 = "bfloat16"  # 8 significand bits: unit roundoff 2^-8
    FP8_E5M2 = "fp8_e5m2"  # torch.float8_e5m2, unscaled: 3 significand bits, unit roundoff 2^-3, max 57344


class PreemptionMode(enum.Enum):
    """How blocks are taken back from a running sequence when they run out (vLLM §4.5)."""

    RECOMPUTE = "recompute"  # free them; the sequence is prefilled again later
    SWAP = "swap"  # copy them to the worker's CPU blocks and back later


class PrefixCacheOutputs(enum.Enum):
    """Which later sequences find a cached block that holds generated tokens (``block_hash.hash_full_blocks``)."""

    SHARED = "shared"  # any prompt that holds those tokens: a chat's next turn hits its last answer
    OWN = "own"  # only the sequence that generated them, resumed or recomputed: prompts get a fresh prefill's bits


class SchedulingPolicy(enum.Enum):
    """The waiting queue's order and whom to preempt (``pagedserve/engine/policy.py``)."""

    FCFS = "fcfs"
    PRIORITY = "priority"


class Placement(enum.Enum):
    """Which worker a waiting sequence is admitted on (``worker_pool.pick_worker``)."""

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


DEFAULT_BLOCK_SIZE = 16
"""Token slots per KV block unless told: the scheduler's and every worker's (they must agree)."""


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one iteration on one worker (its fields' ``help`` documents them).

    Raises:
        ValueError: a non-positive limit, more than ``MAX_PLANS_IN_FLIGHT`` plans in flight,
            a decode slowdown below 1, a short-prompt share outside [0, 1), an admission
            headroom outside [0, 1], an unknown mode or policy.
    """

    block_size: int = option("token slots per KV block; workers must use the same", DEFAULT_BLOCK_SIZE)
    max_num_seqs: int = option("most sequences running on one worker at once", 256)
    max_num_batched_tokens: int | None = option(
        "token budget of one iteration on one worker: decodes first, then prefill chunks within the time "
        "--max-decode-slowdown leaves them", None,
        default_help=f"each worker's by the device it registers: {CPU_TOKEN_BUDGET} on a CPU, {GPU_TOKEN_BUDGET} "
                     "on a GPU")
    enable_chunked_prefill: bool = option(
        "chunked prefill: a prompt longer than what is left of the budget is prefilled over several iterations "
        "(off: each prompt whole in one iteration, and one longer than the budget is refused)", True)
    enable_prefix_caching: bool = option("automatic prefix caching: cached full prompt blocks are shared "
                                         "between requests with the same prefix", True)
    prefix_cache_outputs: PrefixCacheOutputs = option(
        "who finds cached blocks that hold generated tokens: shared, any later prompt holding them (a chat's next "
        "turn hits its last answer; those K/V came from the decode attention op, whose sums differ from a fresh "
        "prefill's in the last bits, so the turn's logprobs move by ~1e-5 with the cache's state), or own, only "
        "the same sequence resumed or recomputed (every prompt gets the bits of a fresh prefill; a chat's next "
        "turn prefills its last answer again: 5.5-6x the time to first token after a 256-token answer on a "
        "2-core CPU, scripts/next_turn_ttft.py)", PrefixCacheOutputs.SHARED)
    preemption_mode: PreemptionMode = option(
        "how to take blocks back from a running sequence when they run out: recompute (free them, prefill "
        "again later) or swap (copy them to the worker's CPU blocks and back; needs workers with --swap-space)",
        PreemptionMode.RECOMPUTE)
    policy: SchedulingPolicy = option("fcfs, or priority (lower request priority runs first; "
                                      "pagedserve/engine/policy.py)", SchedulingPolicy.FCFS, flag="scheduling-policy")
    max_plans_in_flight: int = option(
        f"plans a worker may have been sent before it answers (at most {MAX_PLANS_IN_FLIGHT}): 2 makes the next "
        "plan while the model runs the current one (overlap scheduling: a decoding sequence is scheduled again "
        "before its new token is known, the worker feeds it in itself), 1 makes it after the answer; outputs "
        "are the same (docs/architecture.md, Overlap scheduling)", 2)
    placement: Placement = option(
        "where a new request runs: prefix (the scheduler, then the worker, holding most of its prompt's prefix "
        "in cache, balanced against queues, KV usage and running sequences) or least-loaded (the most free KV "
        "blocks; no forwarding between schedulers)", Placement.PREFIX)
    max_decode_slowdown: float = option(
        "with chunked prefill, a step that runs decodes may take at most this many times as long as the "
        "decodes alone (predicted from the worker's step times, pagedserve/engine/step_cost.py); prefill "
        "chunks beside them are sized to fit, so a long prompt does not stall running streams; inf: chunks "
        "fill the token budget", 2.0)
    short_prompt_share: float = option(
        "with chunked prefill, the most of a step's prefill room (the token budget and time the decodes leave) "
        "that a prompt being prefilled leaves to prompts with fewer tokens left (what they need; running, or "
        "waiting and admissible on its worker now), so that a short request is not queued behind a long prompt's "
        "chunks (shortest remaining first; the long prompt keeps at least 1 - this share of the room); a shorter "
        "prompt is admitted before a longer one waiting for an earlier prompt's chunks "
        "(pagedserve/engine/admission_order.py); 0: first come, first served", 0.5)
    admission_headroom: float = option(
        "a waiting request is admitted only if the free KV blocks then still hold this fraction of the tokens each "
        "running request may yet generate (max_tokens left), so that fewer are preempted and prefilled again; "
        "lowered while nothing is preempted, back at a preemption (SGLang's new-token ratio; clip, decay and "
        "floor in pagedserve/engine/admission.py); 0: admit whatever fits now", 0.7)

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_plans_in_flight"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_plans_in_flight > MAX_PLANS_IN_FLIGHT:
            raise ValueError(f"max_plans_in_flight must be at most {MAX_PLANS_IN_FLIGHT}, got {self.max_plans_in_flight}")
        if not self.max_decode_slowdown >= 1:  # NaN too
            raise ValueError(f"max_decode_slowdown must be at least 1, got {self.max_decode_slowdown}")
        if not 0 <= self.short_prompt_share < 1:  # NaN too
            raise ValueError(f"short_prompt_share must be at least 0 and below 1, got {self.short_prompt_share}")
        if not 0 <= self.admission_headroom <= 1:  # NaN too
            raise ValueError(f"admission_headroom must be between 0 and 1, got {self.admission_headroom}")
        # The enums' values are accepted too (flags, ``LLM(policy="priority")``).
        object.__setattr__(self, "prefix_cache_outputs", PrefixCacheOutputs(self.prefix_cache_outputs))
        object.__setattr__(self, "preemption_mode", PreemptionMode(self.preemption_mode))
        object.__setattr__(self, "policy", SchedulingPolicy(self.policy))
        object.__setattr__(self, "placement", Placement(self.placement))

    def token_budget(self, device: str) -> int:
        """The token budget of a worker on ``device`` (as it registers it: ``cpu``, ``cuda``, ``cuda:1``, ...):
        ``max_num_batched_tokens`` when given, else :func:`default_token_budget` of the device."""
        return default_token_budget(device) if self.max_num_batched_tokens is None else self.max_num_batched_tokens


@dataclass(frozen=True)
class WorkerStats:
    """KV-cache occupancy of one worker, in blocks, and its token budget."""

    worker_id: str
    num_blocks: int
    num_free_blocks: int
    num_running: int
    num_swapped: int = 0
    num_cached_blocks: int = 0
    token_budget: int = 0  # tokens one of its steps computes at most


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
    spec_decode: SpecDecodeCounters | None = None  # drafts verified and accepted; None: no speculation
