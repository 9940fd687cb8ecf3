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
    """Each worker's budget follows the device it registers (docs/benchmarks.md, bench token-budget), in `up`,
    a scheduler alone and the offline engine alike, unless --max-num-batched-tokens sets one for all. The
    standalone scheduler used to keep the GPU's 2048 for CPU workers (review 69: the README's example did)."""
    from pagedserve.cli import build_parser
    from pagedserve.engine.config import CPU_TOKEN_BUDGET, GPU_TOKEN_BUDGET, default_token_budget

    def policy_from_args(args):
        return config_from_args(SchedulerConfig, args)

    assert (default_token_budget("cpu"), default_token_budget("cuda"), default_token_budget("cuda:1")) == (
        CPU_TOKEN_BUDGET, GPU_TOKEN_BUDGET, GPU_TOKEN_BUDGET) == (256, 2048, 2048)
    for command in (["up"], ["scheduler"]):
        policy = policy_from_args(build_parser().parse_args(command))
        assert (policy.token_budget("cpu"), policy.token_budget("cuda:0")) == (256, 2048)
        given = policy_from_args(build_parser().parse_args([*command, "--max-num-batched-tokens", "1024"]))
        assert (given.token_budget("cpu"), given.token_budget("cuda:0")) == (1024, 1024)


def test_each_worker_plans_within_its_own_device_s_budget():
    from pagedserve.engine.messages import EngineRequest
    from pagedserve.engine.sampling_params import EngineSamplingParams
    from pagedserve.engine.scheduler import Scheduler

    scheduler = Scheduler(SchedulerConfig(block_size=16, max_decode_slowdown=float("inf")))
    scheduler.add_worker("cpu-worker", 512, device="cpu")
    scheduler.add_worker("gpu-worker", 512, device="cuda:0")
    assert {w.worker_id: w.token_budget for w in scheduler.stats().workers} == {"cpu-worker": 256, "gpu-worker": 2048}
    params = EngineSamplingParams(max_tokens=4, ignore_eos=True)
    for i in range(2):
        scheduler.add_request(EngineRequest(f"r{i}", tuple(range(3000)), params, float(i)))
    plans = scheduler.schedule(["cpu-worker", "gpu-worker"]).plans
    chunks = {w: [r.num_scheduled_tokens for r in plan.new_requests] for w, plan in plans.items()}
    assert chunks == {"cpu-worker": [256], "gpu-worker": [2048]}


@pytest.mark.parametrize("ttl", [float("nan"), float("inf"), 600.5, 1.0])
def test_the_lease_ttl_is_bounded(ttl):
    """A lease that never expires (inf, NaN) would leave a dead scheduler's requests to nobody, and a gateway
    waits a registered TTL before failing them: --lease-ttl lies in [3 renewals, MAX_LEASE_TTL_S]."""
    from pagedserve.services.common.limits import MAX_LEASE_TTL_S
    from pagedserve.services.scheduler.config import SchedulerServiceConfig

    with pytest.raises(ValueError, match="--lease-ttl must be in"):
        SchedulerServiceConfig(redis_url="redis://unused", cluster_token="t" * 16, lease_ttl_s=ttl)
    assert SchedulerServiceConfig(redis_url="redis://unused", cluster_token="t" * 16,
                                  lease_ttl_s=MAX_LEASE_TTL_S).lease_ttl_s == 600.0
