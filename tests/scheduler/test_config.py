"""Scheduler configuration: validation and the flags round trip `pagedserve up` relies on."""

import argparse

import pytest

from pagedserve.engine.config import SchedulerConfig
from services.scheduler.config import add_policy_arguments, policy_from_args, policy_to_args


@pytest.mark.parametrize("config", [
    SchedulerConfig(),
    SchedulerConfig(block_size=8, max_num_seqs=4, max_num_batched_tokens=32, enable_chunked_prefill=False,
                    enable_prefix_caching=False, preemption_mode="swap", policy="priority"),
])
def test_policy_flags_round_trip(config):
    parser = argparse.ArgumentParser()
    add_policy_arguments(parser)
    assert policy_from_args(parser.parse_args(policy_to_args(config))) == config


@pytest.mark.parametrize("bad", [dict(block_size=0), dict(max_num_seqs=0), dict(preemption_mode="drop"),
                                 dict(policy="lifo")])
def test_invalid_values_raise(bad):
    with pytest.raises(ValueError):
        SchedulerConfig(**bad)
