"""Scheduler configuration: validation and the flags round trip `pagedserve up` relies on."""

import argparse

import pytest

from pagedserve.config_flags import add_config_arguments, config_from_args, config_to_argv
from pagedserve.engine.config import SchedulerConfig


@pytest.mark.parametrize("config", [
    SchedulerConfig(),
    SchedulerConfig(block_size=8, max_num_seqs=4, max_num_batched_tokens=32, enable_chunked_prefill=False,
                    enable_prefix_caching=False, preemption_mode="swap", policy="priority"),
    SchedulerConfig(max_decode_slowdown=float("inf")),
    SchedulerConfig(max_decode_slowdown=1.25),
    SchedulerConfig(short_prompt_share=0.0),
])
def test_policy_flags_round_trip(config):
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, SchedulerConfig)
    assert config_from_args(SchedulerConfig, parser.parse_args(config_to_argv(config))) == config


@pytest.mark.parametrize("bad", [dict(block_size=0), dict(max_num_seqs=0), dict(preemption_mode="drop"),
                                 dict(policy="lifo"), dict(max_decode_slowdown=0.5),
                                 dict(max_decode_slowdown=float("nan")), dict(short_prompt_share=1.0),
                                 dict(short_prompt_share=-0.1), dict(short_prompt_share=float("nan"))])
def test_invalid_values_raise(bad):
    with pytest.raises(ValueError):
        SchedulerConfig(**bad)


def test_token_budget_defaults_follow_the_device():
    """CPU workers get the measured CPU budget (docs/benchmarks.md, bench token-budget): `up` (CPU
    workers) and the offline engine on CPU; the standalone scheduler keeps the GPU-sized default."""
    from pagedserve.cli import build_parser
    from pagedserve.engine.config import CPU_TOKEN_BUDGET, GPU_TOKEN_BUDGET, default_token_budget

    def policy_from_args(args):
        return config_from_args(SchedulerConfig, args)

    assert (default_token_budget("cpu"), default_token_budget("cuda"), default_token_budget("cuda:1")) == (
        CPU_TOKEN_BUDGET, GPU_TOKEN_BUDGET, GPU_TOKEN_BUDGET) == (256, 2048, 2048)
    up = build_parser().parse_args(["up"])
    assert policy_from_args(up).max_num_batched_tokens == 256
    assert policy_from_args(build_parser().parse_args(["up", "--max-num-batched-tokens", "1024"])
                            ).max_num_batched_tokens == 1024
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, SchedulerConfig)
    assert policy_from_args(parser.parse_args([])).max_num_batched_tokens == SchedulerConfig().max_num_batched_tokens
