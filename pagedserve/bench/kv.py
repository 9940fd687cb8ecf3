"""`pagedserve bench kv`: KV-cache utilization of paged blocks against a contiguous reservation.

Replays a prompt set's lengths (no model weights: the tokenizer only) through the scheduler's
``BlockManager`` for several block sizes, and through the pre-paging baseline that reserves
``max_model_len`` contiguous slots per request, at the same KV memory (``kv_slots`` token slots).

The simulation, in steps (one step = one engine iteration):
    * All requests arrive at step 0 and wait in FCFS order.
    * Decode: every running request grows by one token; a request that reaches prompt + output
      tokens finishes and frees its slots (the last sampled token is never written to the cache).
      When a block cannot be had, the most recently admitted request is preempted (recompute:
      its blocks are freed and it goes back to the front of the queue with its progress).
    * Admission (prefill): while the head of the queue has room for prompt + 1 tokens, it is admitted
      and its prompt (plus tokens generated before a preemption) is given slots.
    * Then the step is measured: slots holding tokens and slots allocated.
The contiguous baseline is the same simulation with one block of ``max_model_len`` slots per request.
Utilization = sum over steps of slots holding tokens / sum over steps of slots allocated.
"""

from __future__ import annotations

import argparse
import sys
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pagedserve.bench.datasets import add_dataset_arguments

DEFAULT_BLOCK_SIZES = (8, 16, 32, 64)
DEFAULT_LONGEST_REQUESTS = 16  # the default --kv-slots holds this many copies of the longest request


@dataclass(frozen=True)
class KvResult:
    """One layout's figures.

    Attributes:
        block_size: token slots per block (the baseline: ``max_model_len``, one block per request).
        num_blocks: blocks in the cache (``kv_slots // block_size``).
        utilization: slots holding tokens / slots allocated, time-averaged over steps (0..1).
        waste_pct: ``100 * (1 - utilization)``.
        max_concurrent: most requests holding KV at once.
        steps: engine iterations until every request finished.
        preemptions: requests preempted for lack of blocks.
    """

    block_size: int
    num_blocks: int
    utilization: float
    waste_pct: float
    max_concurrent: int
    steps: int
    preemptions: int


@dataclass
class _Seq:
    seq_id: str
    tokens: int  # tokens whose KV is held (or is to be recomputed, while preempted)
    total: int  # prompt + output tokens


def simulate(lengths: Sequence[tuple[int, int]], num_blocks: int, block_size: int) -> KvResult:
    """Runs the admission simulation of the module docstring.

    Args:
        lengths: ``(prompt tokens, output tokens)`` per request, in arrival order (both >= 1).
        num_blocks: cache capacity in blocks.
        block_size: token slots per block.

    Raises:
        ValueError: a request that cannot fit in the whole cache, or a non-positive length.
    """
    from pagedserve.engine.block_manager import BlockManager, blocks_for_tokens

    for prompt, output in lengths:
        if prompt < 1 or output < 1:
            raise ValueError(f"lengths must be positive, got prompt {prompt}, output {output}")
        if blocks_for_tokens(prompt + output, block_size) > num_blocks:
            raise ValueError(f"a request of {prompt}+{output} tokens does not fit in {num_blocks} blocks "
                             f"of {block_size} slots")
    manager = BlockManager(num_blocks, block_size)
    waiting = deque(_Seq(str(i), p, p + o) for i, (p, o) in enumerate(lengths))
    running: list[_Seq] = []
    used = allocated = steps = most = preemptions = 0
    while waiting or running:
        preemptions += _decode(manager, running, waiting)
        _admit(manager, running, waiting)
        if not running:
            break
        steps += 1
        used += sum(s.tokens for s in running)
        allocated += (manager.num_blocks - manager.num_free_blocks) * block_size
        most = max(most, len(running))
    utilization = used / allocated if allocated else 0.0
    return KvResult(block_size, num_blocks, utilization, 100.0 * (1.0 - utilization), most, steps, preemptions)


def _decode(manager, running: list[_Seq], waiting: deque) -> int:
    """Grows each running request by one token, in admission order; returns the preemptions made."""
    preempted = 0
    i = 0
    while i < len(running):
        seq = running[i]
        if seq.tokens + 1 == seq.total:
            manager.free(seq.seq_id)
            running.pop(i)
            continue
        while not manager.can_allocate(seq.seq_id, seq.tokens + 1):
            victim = running.pop()
            manager.free(victim.seq_id)
            waiting.appendleft(victim)
            preempted += 1
            if victim is seq:
                return preempted
        manager.allocate_slots(seq.seq_id, seq.tokens + 1)
        seq.tokens += 1
        i += 1
    return preempted


def _admit(manager, running: list[_Seq], waiting: deque) -> None:
    """FCFS: admits the head of the queue while it has room for its tokens + 1."""
    while waiting and manager.can_allocate(waiting[0].seq_id, waiting[0].tokens + 1):
        seq = waiting.popleft()
        manager.allocate_slots(seq.seq_id, seq.tokens)
        running.append(seq)


def default_kv_slots(lengths: Sequence[tuple[int, int]], max_model_len: int, block_sizes: Sequence[int]) -> int:
    """``DEFAULT_LONGEST_REQUESTS`` times the longest request (prompt + output, rounded up to the largest
    block size), and at least one ``max_model_len`` reservation so that the baseline can run."""
    step = max(block_sizes)
    longest = max(p + o for p, o in lengths)
    return max(DEFAULT_LONGEST_REQUESTS * (-(-longest // step) * step), max_model_len)


def compare(lengths: Sequence[tuple[int, int]], kv_slots: int, block_sizes: Sequence[int],
            max_model_len: int) -> tuple[list[KvResult], KvResult]:
    """Paged results per block size, and the contiguous baseline, all with ``kv_slots`` token slots.

    Raises:
        ValueError: a request longer than ``max_model_len``, or ``kv_slots`` below one reservation.
    """
    if kv_slots < max_model_len:
        raise ValueError(f"--kv-slots {kv_slots} cannot hold one {max_model_len}-slot reservation")
    too_long = [p + o for p, o in lengths if p + o > max_model_len]
    if too_long:
        raise ValueError(f"{len(too_long)} requests exceed --max-model-len {max_model_len} (longest {max(too_long)})")
    paged = [simulate(lengths, kv_slots // size, size) for size in block_sizes]
    return paged, simulate(lengths, kv_slots // max_model_len, max_model_len)


def format_results(paged: Sequence[KvResult], baseline: KvResult) -> str:
    """The rows as a table: utilization and waste in %, concurrency in requests."""
    from pagedserve.bench.report import format_table

    headers = ["layout", "block size", "blocks", "utilization %", "waste %", "max concurrent", "steps",
               "preemptions"]
    rows = [["paged", r.block_size, r.num_blocks, 100 * r.utilization, r.waste_pct, r.max_concurrent, r.steps,
             r.preemptions] for r in paged]
    b = baseline
    rows.append([f"contiguous ({b.block_size}/req)", b.block_size, b.num_blocks, 100 * b.utilization, b.waste_pct,
                 b.max_concurrent, b.steps, b.preemptions])
    return format_table(headers, rows, title=" KV-cache utilization: paged vs contiguous ")


def _parse_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a list of block sizes: {text!r}") from exc
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"block sizes must be positive, got {text!r}")
    return sizes


def run_kv(args: argparse.Namespace) -> int:
    """Runs `pagedserve bench kv`; 0 on success, 2 on bad input (dataset, lengths, sizes)."""
    from transformers import AutoTokenizer

    from pagedserve.bench.datasets import DatasetError, dataset_spec_from_args, sample_requests
    from pagedserve.bench.report import write_json
    from pagedserve.model_files import resolve_model
    from pagedserve.engine.model_info import load_model_info

    try:
        model = resolve_model(args.model or None)
        max_model_len = args.max_model_len or load_model_info(model).max_model_len
        samples = sample_requests(dataset_spec_from_args(args), AutoTokenizer.from_pretrained(str(model)))
        lengths = [(s.prompt_len, s.expected_output_len) for s in samples]
        kv_slots = args.kv_slots or default_kv_slots(lengths, max_model_len, args.block_sizes)
        paged, baseline = compare(lengths, kv_slots, args.block_sizes, max_model_len)
    except (DatasetError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{len(lengths)} requests: prompt {sum(p for p, _ in lengths) / len(lengths):.1f} tokens on average, "
          f"output {sum(o for _, o in lengths) / len(lengths):.1f}, longest {max(p + o for p, o in lengths)} in all; "
          f"KV memory {kv_slots} token slots; max_model_len {max_model_len}")
    print(format_results(paged, baseline))
    if args.result_json:
        row_keys = ("block_size", "num_blocks", "utilization", "waste_pct", "max_concurrent", "steps", "preemptions")
        write_json(args.result_json, {
            "rows": [{k: getattr(r, k) for k in row_keys} for r in paged],
            "baseline": {"reserved_per_request": max_model_len,
                         **{k: getattr(baseline, k) for k in row_keys if k != "block_size"}},
            "settings": {"model": str(model), "dataset_name": args.dataset_name, "dataset_path": args.dataset_path,
                         "num_prompts": args.num_prompts, "seed": args.seed, "input_len": args.input_len,
                         "output_len": args.output_len, "range_ratio": args.range_ratio, "kv_slots": kv_slots,
                         "max_model_len": max_model_len, "block_sizes": list(args.block_sizes)},
            "requests": [{"prompt_len": p, "output_len": o} for p, o in lengths],
        })
    return 0


def add_parser(sub: "argparse._SubParsersAction") -> None:
    """Adds `pagedserve bench kv`."""
    p = sub.add_parser(
        "kv", help="KV-cache utilization: paged blocks vs a contiguous max-length reservation (no weights)",
        description="Replay a prompt set's prompt+output lengths through the scheduler's block manager at several "
        "block sizes and through a baseline that reserves max_model_len slots per request, with the same KV "
        "memory; report utilization (slots holding tokens / slots allocated, time-averaged), waste and the most "
        "requests held at once. FCFS admission, all requests arriving at once, one token per step.")
    p.add_argument("--model", default="", help="model folder for the tokenizer and max length "
                   "(default: the default model, SmolLM2-135M-Instruct)")
    add_dataset_arguments(p)
    kv = p.add_argument_group("KV cache")
    kv.add_argument("--block-sizes", type=_parse_sizes, default=DEFAULT_BLOCK_SIZES, metavar="SIZES",
                    help="comma-separated token slots per block (default 8,16,32,64)")
    kv.add_argument("--max-model-len", type=int, default=0,
                    help="slots the contiguous baseline reserves per request (default: the model's "
                    "max_position_embeddings, 8192 for the default model)")
    kv.add_argument("--kv-slots", type=int, default=0,
                    help=f"KV memory in token slots, the same for every layout (default: {DEFAULT_LONGEST_REQUESTS} "
                    "times the longest request rounded up to the largest block size, and at least --max-model-len)")
    p.add_argument("--result-json", type=Path, help="write rows, baseline, settings and request lengths as JSON")
    p.set_defaults(func=run_kv)
