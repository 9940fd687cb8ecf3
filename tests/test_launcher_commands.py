"""`pagedserve up` starts each service with flags its own command accepts, and passes on the
settings it was given (scheduler policy, the workers' rank grid and kernels)."""

from __future__ import annotations

import math

from pagedserve.cli import build_parser
from pagedserve.config_flags import config_from_args
from pagedserve.engine.config import CompileMode, GemmBackend, SchedulerConfig
from pagedserve.engine.runner_config import EngineConfig, RunnerConfig
from pagedserve.engine.spec_decode.config import SpeculativeConfig
from pagedserve.launcher import STOP_TIMEOUT_S, Stack
from pagedserve.stack_config import StackConfig
from pagedserve.llm import offline_config
from pagedserve.services.gateway.config import SHUTDOWN_CLOSE_S


RANK_GRID = RunnerConfig(kv_cache_memory="64MiB", tensor_parallel_size=2, pipeline_parallel_size=2, virtual_engines=1,
                         compile_mode=CompileMode.INDUCTOR, gemm_backend=GemmBackend.ONEDNN, kv_cache_dtype="fp8_e5m2")


def up_commands(tmp_path, monkeypatch, policy: SchedulerConfig, runner: RunnerConfig = RANK_GRID,
                speculative: SpeculativeConfig = SpeculativeConfig()) -> list:
    """The parsed command lines `up` starts its services with (two schedulers, two workers)."""
    config = StackConfig(model=tmp_path, workers=2, host="127.0.0.1", port=1, scheduler_port=2,
                         redis_url="redis://127.0.0.1:9/0", policy=policy, threads_per_worker=1, data_dir=tmp_path,
                         runner=runner, schedulers=2, speculative_config=speculative)
    stack, commands = Stack(config), []
    monkeypatch.setattr(stack, "_start_redis", lambda: None)  # nothing is started: only the commands are read
    monkeypatch.setattr(stack, "_wait_ready", lambda: None)
    monkeypatch.setattr(stack, "_service", lambda name, *args: commands.append(list(args)))
    stack.start()
    return [build_parser().parse_args(args) for args in commands]  # exits (fails) on an unknown flag


def test_every_command_up_starts_parses_and_carries_its_settings(tmp_path, monkeypatch):
    policy = SchedulerConfig(max_plans_in_flight=1, placement="least-loaded", max_num_batched_tokens=128,
                             max_decode_slowdown=1.5)
    parsed = up_commands(tmp_path, monkeypatch, policy)
    assert [p.command for p in parsed] == ["scheduler", "scheduler", "worker", "worker", "gateway"]
    scheduler, worker, gateway = parsed[0], parsed[2], parsed[4]
    assert [(p.consumer_name, p.port) for p in parsed[:2]] == [("scheduler-0", 2), ("scheduler-1", 3)]  # one id each
    assert "scheduler" not in vars(gateway)  # the gateway finds the schedulers in Redis
    assert (scheduler.max_plans_in_flight, scheduler.placement, scheduler.max_num_batched_tokens) == (1, "least-loaded", 128)
    assert scheduler.max_decode_slowdown == 1.5
    assert (worker.tensor_parallel_size, worker.pipeline_parallel_size, worker.virtual_engines) == (2, 2, 1)
    assert (worker.compile_mode, worker.gemm_backend, worker.kv_cache_dtype) == ("inductor", "onednn", "fp8_e5m2")
    assert gateway.shutdown_grace_s + SHUTDOWN_CLOSE_S <= STOP_TIMEOUT_S  # up waits for the gateway's drain


def test_prefill_chunk_sizing_defaults_agree_in_the_scheduler_and_up_and_the_offline_engine_fills_the_budget(
        tmp_path, monkeypatch):
    """How long a step with decodes may take (``max_decode_slowdown``, issue #20): one default,
    SchedulerConfig's, wherever the services run a scheduler; the offline engine, with no stream to
    pace, fills the token budget unless told otherwise."""
    def policy_from_args(args):
        return config_from_args(SchedulerConfig, args, SchedulerConfig())

    default = SchedulerConfig().max_decode_slowdown
    assert default == 2.0
    assert EngineConfig.of().scheduler.max_decode_slowdown == default
    assert offline_config().scheduler.max_decode_slowdown == math.inf  # what LLM(...) runs with
    assert offline_config(max_decode_slowdown=3.0).scheduler.max_decode_slowdown == 3.0
    assert offline_config(block_size=8).scheduler.block_size == 8
    # no first token to hurry either: prompts first come, first served offline, half the room for a shorter one in
    # the services
    assert (offline_config().scheduler.short_prompt_share, SchedulerConfig().short_prompt_share) == (0.0, 0.5)
    assert offline_config(short_prompt_share=0.5).scheduler.short_prompt_share == 0.5
    standalone = build_parser().parse_args(["scheduler", "--redis-url", "redis://127.0.0.1:3/0"])
    assert standalone.max_decode_slowdown == default
    up_policy = policy_from_args(build_parser().parse_args(["up"]))
    assert up_policy.max_decode_slowdown == default
    assert [p.max_decode_slowdown for p in up_commands(tmp_path, monkeypatch, up_policy)[:2]] == [default, default]


def test_up_gives_the_schedulers_and_the_workers_the_same_speculative_config(tmp_path, monkeypatch):
    """The schedulers reserve the slots the workers draft into: one config, passed to both."""
    speculative = SpeculativeConfig(method="ngram", num_speculative_tokens=3, control="fixed", prompt_lookup_min=2,
                                    prompt_lookup_max=5)
    parsed = up_commands(tmp_path, monkeypatch, SchedulerConfig(), RunnerConfig(), speculative)
    services = [p for p in parsed if p.command in ("scheduler", "worker")]
    assert len(services) == 4
    assert all(config_from_args(SpeculativeConfig, p) == speculative for p in services)


def test_up_dials_its_gateway_where_it_listens(tmp_path):
    """Loopback for an every-address listen, else ``--host`` itself (IPv6 in brackets)."""
    def address(host: str) -> str:
        return StackConfig(model=tmp_path, host=host, port=7, redis_url="redis://127.0.0.1:9/0",
                           data_dir=tmp_path).gateway_address(8)

    assert [address(h) for h in ("127.0.0.1", "0.0.0.0", "::", "::1", "10.1.2.3", "gw.local")] == [
        "127.0.0.1:8", "127.0.0.1:8", "[::1]:8", "[::1]:8", "10.1.2.3:8", "gw.local:8"]


def test_a_host_flag_in_brackets_is_the_bare_address(tmp_path):
    """``--host [::1]`` (as URLs write it) listens on ``::1``: the HTTP and metrics sockets take no brackets."""
    from pagedserve.services.scheduler.config import SchedulerServiceConfig

    up = build_parser().parse_args(["up", "--host", "[::1]", "--model", str(tmp_path)])
    assert config_from_args(StackConfig, up).host == "::1"
    scheduler = build_parser().parse_args(["scheduler", "--host", "[::]", "--cluster-token", "t" * 16])
    assert config_from_args(SchedulerServiceConfig, scheduler).host == "::"
