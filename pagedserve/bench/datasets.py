"""Benchmark prompt sets, sampled as vLLM's benchmarks sample them.

Each loader returns ``SampleRequest`` values: the prompt text, its length in tokens, and the
number of tokens the request should generate. Dataset names follow vLLM's ``--dataset-name``:
``sharegpt``, ``sonnet`` and ``random``; ``alpaca``, ``mt-bench`` and ``prompts`` read the other
sets in the workspace's ``shared/data`` (see its PROVENANCE.md).
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

DATASET_NAMES = ("sharegpt", "sonnet", "random", "alpaca", "mt-bench", "prompts")


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


@dataclass(frozen=True)
class SampleRequest:
    """One benchmark request.

    Attributes:
        prompt: text sent as the prompt (no chat template, as vLLM's benchmarks send it).
        prompt_len: its length in tokens.
        expected_output_len: tokens to generate (``max_tokens``).
    """

    prompt: str
    prompt_len: int
    expected_output_len: int


class DatasetError(ValueError):
    """The dataset file is missing, malformed, or yields too few usable requests."""


@dataclass(frozen=True)
class DatasetSpec:
    """What to sample. ``output_len``: a fixed output length (else the dataset's own, where it has one)."""

    name: str
    path: Path | None
    num_prompts: int
    seed: int = 0
    input_len: int = 256
    output_len: int | None = None
    range_ratio: float = 0.0
    max_prompt_len: int = 1024
    max_total_len: int = 2048


def add_dataset_arguments(parser: argparse.ArgumentParser) -> None:
    """The dataset flags shared by the bench commands (vLLM's names)."""
    g = parser.add_argument_group("dataset")
    g.add_argument("--dataset-name", choices=DATASET_NAMES, default="sharegpt", help="prompt set (default %(default)s)")
    g.add_argument("--dataset-path", type=Path, help="the dataset file (not needed for random)")
    g.add_argument("--num-prompts", type=int, default=64, help="requests to send (default %(default)s)")
    g.add_argument("--seed", type=int, default=0, help="sampling seed (default %(default)s)")
    g.add_argument("--input-len", type=int, default=256, help="random: prompt tokens (default %(default)s)")
    g.add_argument("--output-len", type=int, help="fixed output tokens per request (default: the dataset's own; "
                   "random: 128)")
    g.add_argument("--range-ratio", type=float, default=0.0,
                   help="random: lengths drawn from [len*(1-r), len*(1+r)] (default %(default)s)")


def dataset_spec_from_args(args: argparse.Namespace) -> DatasetSpec:
    return DatasetSpec(args.dataset_name, args.dataset_path, args.num_prompts, args.seed, args.input_len,
                       args.output_len, args.range_ratio)


def sample_requests(spec: DatasetSpec, tokenizer: Tokenizer) -> list[SampleRequest]:
    """Samples ``spec.num_prompts`` requests.

    Raises:
        DatasetError: no path for a file dataset, a malformed file, or too few usable entries.
    """
    if spec.num_prompts < 1:
        raise DatasetError(f"--num-prompts must be at least 1, got {spec.num_prompts}")
    if spec.name == "random":
        return _sample_random(spec, tokenizer)
    if spec.path is None or not spec.path.is_file():
        raise DatasetError(f"--dataset-path must name the {spec.name} file (got {spec.path}); or use "
                           "--dataset-name random, which needs no file (--input-len, --output-len)")
    loaders: dict[str, Callable[[Path], list[tuple[str, str | None]]]] = {
        "sharegpt": _sharegpt_pairs,
        "alpaca": _alpaca_pairs,
        "mt-bench": _mt_bench_pairs,
        "prompts": _line_pairs,
    }
    if spec.name == "sonnet":
        return _sample_sonnet(spec, tokenizer)
    return _sample_pairs(spec, tokenizer, loaders[spec.name](spec.path))


def _sample_pairs(spec: DatasetSpec, tokenizer: Tokenizer, pairs: list[tuple[str, str | None]]) -> list[SampleRequest]:
    """vLLM's ShareGPT rule: shuffle, tokenize, drop too short (< 4 tokens) or too long pairs."""
    rng = random.Random(spec.seed)
    rng.shuffle(pairs)
    sampled: list[SampleRequest] = []
    for prompt, completion in pairs:
        if len(sampled) == spec.num_prompts:
            break
        prompt_len = len(tokenizer.encode(prompt))
        if spec.output_len is not None:
            output_len = spec.output_len
        elif completion is not None:
            output_len = len(tokenizer.encode(completion))
        else:
            raise DatasetError(f"{spec.name} has no reference outputs: give --output-len")
        if prompt_len < 4 or output_len < 4:
            continue
        if prompt_len > spec.max_prompt_len or prompt_len + output_len > spec.max_total_len:
            continue
        sampled.append(SampleRequest(prompt, prompt_len, output_len))
    if len(sampled) < spec.num_prompts:
        raise DatasetError(f"{spec.path} gave {len(sampled)} usable requests, {spec.num_prompts} asked for")
    return sampled


def _load_json(path: Path) -> object:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise DatasetError(f"cannot read {path}: {exc}") from exc


def _sharegpt_pairs(path: Path) -> list[tuple[str, str | None]]:
    """First human turn and, when it follows, the first reply. Conversations starting otherwise are skipped."""
    pairs: list[tuple[str, str | None]] = []
    for conv in _load_json(path):
        turns = conv.get("conversations") or []
        if not turns or turns[0].get("from") != "human":
            continue
        reply = turns[1]["value"] if len(turns) > 1 and turns[1].get("from") == "gpt" else None
        if len(turns) > 1 and reply is None:
            continue
        pairs.append((turns[0]["value"], reply))
    return pairs


def _alpaca_pairs(path: Path) -> list[tuple[str, str | None]]:
    return [
        ((r["instruction"] + ("\n\n" + r["input"] if r.get("input") else "")), r.get("output"))
        for r in _load_json(path)
    ]


def _mt_bench_pairs(path: Path) -> list[tuple[str, str | None]]:
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [(r["turns"][0], None) for r in lines]


def _line_pairs(path: Path) -> list[tuple[str, str | None]]:
    return [(line, None) for line in path.read_text().splitlines() if line.strip()]


def _sample_sonnet(spec: DatasetSpec, tokenizer: Tokenizer) -> list[SampleRequest]:
    """vLLM's sonnet set: a fixed instruction, then random lines of the poem up to ``input_len`` tokens."""
    lines = [line for line in spec.path.read_text().splitlines() if line.strip()]
    rng = random.Random(spec.seed)
    base = "Pick as many lines as you can from these poem lines:\n"
    output_len = spec.output_len or 150
    sampled = []
    for _ in range(spec.num_prompts):
        prompt = base
        while len(tokenizer.encode(prompt)) < spec.input_len:
            prompt += rng.choice(lines) + "\n"
        sampled.append(SampleRequest(prompt, len(tokenizer.encode(prompt)), output_len))
    return sampled


def _sample_random(spec: DatasetSpec, tokenizer: Tokenizer) -> list[SampleRequest]:
    """Random token ids decoded to text, lengths uniform in ``len * [1 - r, 1 + r]``."""
    rng = random.Random(spec.seed)
    output_base = spec.output_len or 128
    sampled = []
    for _ in range(spec.num_prompts):
        in_len = max(1, round(spec.input_len * rng.uniform(1 - spec.range_ratio, 1 + spec.range_ratio)))
        out_len = max(1, round(output_base * rng.uniform(1 - spec.range_ratio, 1 + spec.range_ratio)))
        ids = [rng.randrange(1000, 40000) for _ in range(in_len)]
        prompt = tokenizer.decode(ids)
        sampled.append(SampleRequest(prompt, len(tokenizer.encode(prompt)), out_len))
    return sampled
