"""Configs made from their dataclasses' fields: every service config goes through its own flags
and comes back equal (what `pagedserve up` relies on to start its children), and LLM's options
are the engine config's fields."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedserve.cli import build_parser
from pagedserve.config_flags import config_from_args, config_to_argv
from pagedserve.engine.config import SchedulerConfig
from pagedserve.engine.runner_config import EngineConfig, RunnerConfig
from pagedserve.engine.spec_decode.config import SpeculativeConfig
from pagedserve.services.gateway.config import GatewayConfig
from pagedserve.services.scheduler.config import SchedulerServiceConfig
from pagedserve.services.worker.config import WorkerConfig

TOKEN = "a-long-enough-cluster-token"


@pytest.mark.parametrize("command, config", [
    ("scheduler", SchedulerServiceConfig(cluster_token=TOKEN, port=7, consumer_name="s-1", lease_ttl_s=4.5,
                                         policy=SchedulerConfig(enable_chunked_prefill=False, policy="priority",
                                                                max_decode_slowdown=float("inf")))),
    ("worker", WorkerConfig(model=Path("/m"), cluster_token=TOKEN, worker_id="w-1", cpu_affinity=(0, 1, 3),
                            runner=RunnerConfig(kv_cache_memory="512MiB", swap_space="3MiB", gemm_backend="onednn",
                                                pipeline_parallel_size=2, virtual_engines=2))),
    ("worker", WorkerConfig(model=Path("/m"), cluster_token=TOKEN,  # no binding: written as --cpu-affinity ''
                            speculative_config=SpeculativeConfig(method="ngram", num_speculative_tokens=2,
                                                                 prompt_lookup_min=2, prompt_lookup_max=3))),
    ("worker", WorkerConfig(model=Path("/m"), cluster_token=TOKEN,  # --model and --speculative-model apart
                            speculative_config=SpeculativeConfig(method="draft_model", model="/d"))),
    ("scheduler", SchedulerServiceConfig(cluster_token=TOKEN, speculative_config=SpeculativeConfig(
        method="ngram", num_speculative_tokens=2))),
    ("gateway", GatewayConfig(model=Path("/m"), cluster_token=TOKEN, gateway_id="g-1", tls_cert_file=Path("c"),
                              tls_key_file=Path("k"), metrics_port=0, shutdown_grace_s=2.5)),
])
def test_a_service_config_comes_back_equal_from_its_flags(monkeypatch, command, config):
    monkeypatch.setenv("PAGEDSERVE_CLUSTER_TOKEN", TOKEN)  # secrets travel in the environment, not argv
    argv = config_to_argv(config)
    assert TOKEN not in argv
    given = {"model": config.model} if hasattr(config, "model") else {}
    for parser in (build_parser(), build_parser(command)):  # every command's flags, or only this one's
        assert config_from_args(type(config), parser.parse_args([command, *argv]), **given) == config


@pytest.mark.parametrize("command, argv, message", [
    ("scheduler", ["--short-prompt-share", "1.5"], "--short-prompt-share must be at least 0 and below 1, got 1.5"),
    ("scheduler", ["--max-num-batched-tokens", "0"], "--max-num-batched-tokens must be at least 1, got 0"),
    ("scheduler", ["--step-timeout", "0"], "--step-timeout must be positive, got 0.0"),  # a flag of another name
    ("worker", ["--speculative-method", "ngram", "--prompt-lookup-min", "3", "--prompt-lookup-max", "2"],
     "--prompt-lookup-min <= --prompt-lookup-max"),
])
def test_a_bad_value_is_named_by_its_flag(monkeypatch, command, argv, message):
    """A config's own validation names its fields (it is built in-process too); from flags, the error names the
    flags the user typed."""
    monkeypatch.setenv("PAGEDSERVE_CLUSTER_TOKEN", TOKEN)
    given = {"model": Path("/m")} if command == "worker" else {}
    config_type = {"scheduler": SchedulerServiceConfig, "worker": WorkerConfig}[command]
    with pytest.raises(ValueError, match=message):
        config_from_args(config_type, build_parser(command).parse_args([command, *argv]), **given)


def test_a_command_line_builds_only_its_commands_flags():
    """`pagedserve worker ...` builds the worker's flags alone: the other commands' configs and modules
    (the launcher, the benchmarks, the gateway's config) are not imported; `pagedserve` alone (or an
    unknown command) builds them all."""
    import subprocess
    import sys

    others = ("pagedserve.launcher", "pagedserve.stack_config", "pagedserve.bench.cli",
              "pagedserve.services.gateway.config")
    code = ("import sys; from pagedserve.cli import build_parser; build_parser('worker').parse_args(['worker']); "
            f"print([m for m in {others!r} if m in sys.modules])")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "[]", result.stderr
    from pagedserve.cli import COMMANDS

    for command in (None, "no-such-command"):
        subcommands = next(a for a in build_parser(command)._actions if a.dest == "command")
        assert list(subcommands.choices) == list(COMMANDS)


def test_two_flags_that_would_share_a_value_are_refused():
    import argparse
    from dataclasses import dataclass

    from pagedserve.config_flags import add_config_arguments
    from pagedserve.options import option

    @dataclass(frozen=True)
    class Draft:
        model: str = option("the draft", "")

    parser = argparse.ArgumentParser()
    parser.add_argument("--model")
    with pytest.raises(ValueError, match="--model: its value would share args.model"):
        add_config_arguments(parser, Draft)


def test_llm_options_are_the_engine_config_s_fields():
    config = EngineConfig.of(block_size=8, gemm_backend="onednn", kv_cache_memory="4MiB", num_workers=2)
    assert (config.scheduler.block_size, config.runner.gemm_backend.value, config.runner.kv_cache_memory,
            config.num_workers) == (8, "onednn", 4 << 20, 2)
    assert config.scheduler.max_num_batched_tokens == 256  # the CPU token budget
    assert EngineConfig.of(device="cuda").scheduler.max_num_batched_tokens == 2048
    with pytest.raises(TypeError, match="num_virtual_engines"):
        EngineConfig.of(num_virtual_engines=2)


def test_pipeline_and_tensor_parallel_workers_take_a_draft_model_and_ngram():
    for method, model in (("draft_model", "/d"), ("ngram", None)):
        for runner in (RunnerConfig(pipeline_parallel_size=2), RunnerConfig(tensor_parallel_size=2)):
            config = WorkerConfig(model=Path("/m"), cluster_token=TOKEN, runner=runner,
                                  speculative_config=SpeculativeConfig(method=method, model=model))
            assert config.speculative_config.num_lookahead_tokens == 4
