"""Test helpers for tensor and pipeline parallelism: the same forward steps run by a group of ranks
or by one model; the tiny model, prompts and KV budget of the ``LLM`` tests."""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch

from pagedserve.engine.attention import make_attention_backend
from pagedserve.engine.parallel.group import GroupSpec, TensorParallelGroup, dial_rendezvous, serve_rendezvous
from pagedserve.engine.sampling_params import SamplingParams
from tests.worker.tiny_models import forward_step, make_cache, save_tiny_model, save_tiny_tokenizer

BLOCK = 4
# Two steps over three sequences: a ragged prefill (5, 9, 3 tokens), then one decode token each.
PREFILL = [[5, 17, 33, 2, 90], [1, 2, 3, 4, 5, 6, 7, 8, 9], [60, 61, 62]]
DECODE = [[11], [12], [13]]
TABLES = [[7, 2], [0, 5, 9], [3]]


GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
BLOCK_BYTES_ONE_RANK = 2 * 2 * BLOCK * 2 * 16 * 4  # K+V, 2 layers, 4 slots, 2 KV heads, head_dim 16, float32
NUM_BLOCKS = 24  # 96 token slots for a dozen prompts of up to 41 tokens: preemption happens
TIMEOUT_BOUND_S = 30.0  # the collectives' 15 s timeout (COLLECTIVE_TIMEOUT_S) plus slack on two busy cores


def tiny_model_and_prompts(folder: Path, lengths: tuple[int, ...], arch: str = "llama",
                           **overrides) -> tuple[Path, list[list[int]]]:
    """The tiny ``arch`` model (default Llama; seed 7, with a tokenizer) saved in ``folder``, and seeded
    random prompts of ``lengths`` tokens followed by two that share a 9-token prefix (for the prefix cache)."""
    model = save_tiny_tokenizer(save_tiny_model(folder, arch, seed=7, **overrides))
    rng = random.Random(3)
    shared = [rng.randrange(3, 96) for _ in range(9)]
    prompts = [[rng.randrange(3, 96) for _ in range(n)] for n in lengths]
    return model, prompts + [shared + [17, 18], shared + [40, 41, 42, 43, 44]]


def generated_tokens(llm, prompts) -> list[list[int]]:
    """Greedy tokens of every prompt (``GREEDY``)."""
    return [list(r.token_ids) for r in llm.generate(prompts, GREEDY)]


def assert_a_dead_or_stuck_rank_fails_the_step(llm, runner, pid: int, how: str, prompts) -> None:
    """Kills (``how="killed"``) or stops (``"stopped"``) process ``pid``, a rank of ``runner``'s worker;
    the next ``llm.generate`` must raise ``CollectiveError`` within ``TIMEOUT_BOUND_S`` and the
    runner stay failed. A stopped process is killed at the end."""
    from pagedserve.engine.parallel.group import CollectiveError

    os.kill(pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
    started = time.monotonic()
    with pytest.raises(CollectiveError) as failure:
        llm.generate(prompts, GREEDY)
    elapsed = time.monotonic() - started
    print(f"{how}: the step raised after {elapsed:.1f} s: {failure.value}")
    assert elapsed < TIMEOUT_BOUND_S
    with pytest.raises(CollectiveError):  # the worker stays failed
        runner.execute(None)
    if how == "stopped":
        os.kill(pid, signal.SIGKILL)


def assert_seeded_sampling_equal_one_rank(folder: Path, prompts, **parallel) -> None:
    """Seeded random sampling with n=2, output and prompt logprobs: ``LLM(**parallel)`` gives the
    same tokens as one rank (the sampler sees the same per-request seeds), logprobs within 1e-4."""
    from pagedserve.llm import LLM

    params = SamplingParams(max_tokens=6, temperature=1.0, seed=17, n=2, logprobs=2, prompt_logprobs=2,
                            ignore_eos=True)
    memory = NUM_BLOCKS * BLOCK_BYTES_ONE_RANK
    single = LLM(folder, kv_cache_memory=memory, block_size=BLOCK).generate(prompts, params)
    with LLM(folder, kv_cache_memory=memory, block_size=BLOCK, **parallel) as llm:
        split = llm.generate(prompts, params)
    for ours, ref in zip(split, single, strict=True):
        assert [list(s.token_ids) for s in ours.samples] == [list(s.token_ids) for s in ref.samples]
        for s, r in zip(ours.samples, ref.samples):
            assert s.cumulative_logprob == pytest.approx(r.cumulative_logprob, abs=1e-4)
        got = [p.logprob for p in ours.prompt_logprobs[1:]]
        want = [p.logprob for p in ref.prompt_logprobs[1:]]
        assert got == pytest.approx(want, abs=1e-4)


def two_steps(model, backend: str = "torch", cache=None, forward=None) -> list[torch.Tensor]:
    """Logits ``[T, V]`` of the prefill step and of the decode step (same block tables) through the
    attention ``backend`` (``torch`` or ``cpu``); ``cache``/``forward``: a pipeline stage's (its
    runner's), whose logits are the model's on the last stage only."""
    cache = make_cache(model, 12, BLOCK) if cache is None else cache
    attention = make_attention_backend(backend, "cpu")
    prefill = forward_step(model, cache, attention, PREFILL, [0, 0, 0], TABLES, forward=forward)
    decode = forward_step(model, cache, attention, DECODE, [len(p) for p in PREFILL], TABLES, forward=forward)
    return [prefill, decode]


def parent_rendezvous(world_size: int) -> tuple[GroupSpec, object]:
    """A rendezvous this test process serves for the rank processes it spawns (every rank dials it,
    rank 0 too: :func:`join_parent`): ``(spec, store)``; keep the store until the ranks are done."""
    return serve_rendezvous(GroupSpec("tcp://127.0.0.1:0", world_size, timeout_s=30.0))


def join_parent(spec: GroupSpec, rank: int) -> TensorParallelGroup:
    """Joins, as ``rank``, the group whose rendezvous the test process serves."""
    return TensorParallelGroup(spec, rank, dial_rendezvous(spec))


def rank_main(rank: int, folder: str, spec: GroupSpec, out: str) -> None:
    """One rank: builds its shard, runs :func:`two_steps`; rank 0 saves the logits to ``out``."""
    from pagedserve.engine.parallel.rank import load_model_shard

    torch.set_num_threads(1)
    group = join_parent(spec, rank)
    try:
        model = load_model_shard(folder, group, torch.float32, "cpu")
        logits = two_steps(model)
        if rank == 0:
            torch.save(logits, Path(out))
    finally:
        group.close()


def grid_rank_main(rank: int, folder: str, spec: GroupSpec, sizes: tuple[int, int], out: str) -> None:
    """One rank of a ``T x P`` grid: builds its runner, runs the :func:`two_steps` forwards through its
    stage; the last stage's tensor-parallel rank 0 saves the logits to ``out``."""
    from pagedserve.engine.parallel.rank import RankConfig, build_stage_runners

    torch.set_num_threads(1)
    t, p = sizes
    group = join_parent(spec, rank)
    try:
        runner = build_stage_runners(RankConfig(folder, 1 << 20, BLOCK, pipeline_parallel_size=p), group)[0]
        logits = two_steps(runner.model, cache=runner.kv_cache, forward=runner.forward)
        if rank == (p - 1) * t:  # the last stage's tensor-parallel rank 0
            torch.save(logits, Path(out))
    finally:
        group.close()


def split_two_ways_main(rank: int, cases: dict[str, tuple[str, tuple[str, ...]]], spec: GroupSpec, out: str) -> None:
    """One of 2 ranks, for every case ``name -> (folder, attention backends)``: :func:`two_steps` over
    its T=2 shard, then over its stage of P=2 (one group serves both: T=2 x P=1 and T=1 x P=2), per
    backend. Rank 0 saves the T=2 logits, rank 1 (the last stage) the P=2 ones, in ``out/NAME.tp.pt``
    and ``out/NAME.pp.pt`` (``{backend: [prefill, decode]}``)."""
    from pagedserve.engine.parallel.rank import RankConfig, build_stage_runners, load_model_shard

    torch.set_num_threads(1)
    group = join_parent(spec, rank)
    try:
        for name, (folder, backends) in cases.items():
            model = load_model_shard(folder, group, torch.float32, "cpu")
            tp = {b: two_steps(model, b) for b in backends}
            runner = build_stage_runners(RankConfig(folder, 1 << 20, BLOCK, pipeline_parallel_size=2), group)[0]
            pp = {b: two_steps(runner.model, b, make_cache(runner.model, 12, BLOCK), runner.forward) for b in backends}
            torch.save(tp if rank == 0 else pp, Path(out) / f"{name}.{'tp' if rank == 0 else 'pp'}.pt")
    finally:
        group.close()
