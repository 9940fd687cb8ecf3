"""The README's flag tables are the parsers' (issue #24: the README gave `up` a token budget of 2048
where `up --help` said 256, and `complete --help` spoke of a --kv-cache-memory it did not have)."""

from __future__ import annotations

from pagedserve.config_flags import config_from_args
from pagedserve.engine.runner_config import EngineConfig
from pagedserve.readme_flags import README, clean_parser, flag_tables, rewrite


def test_regenerating_the_readme_flag_tables_changes_nothing():
    text = README.read_text()
    assert rewrite(text, flag_tables(clean_parser())) == text, "run: python -m pagedserve.readme_flags"


def test_the_tables_give_each_command_its_own_defaults():
    tables = flag_tables(clean_parser())
    up, worker = tables.split("<code>pagedserve up</code>")[1], tables.split("<code>pagedserve worker</code>")[1]

    def row(table: str, flag: str) -> str:
        return table.split(f"| `{flag}` |")[1].split("\n")[0]

    assert row(up, "--kv-cache-memory").endswith("default 1GiB) |")
    assert row(worker, "--kv-cache-memory").endswith("default: 1GiB on CPU, on CUDA what --gpu-memory-utilization "
                                                     "leaves after the weights) |")
    assert "(default: each worker's by the device it registers: 256 on a CPU, 2048 on a GPU) |" in row(
        up, "--max-num-batched-tokens")


def test_complete_offline_takes_the_kv_cache_memory_its_help_speaks_of():
    parser = clean_parser()
    args = parser.parse_args(["complete", "--offline", "--prompt", "x", "--kv-cache-memory", "64MiB"])
    assert config_from_args(EngineConfig, args, EngineConfig.of()).runner.kv_cache_memory == 64 << 20


def test_the_readme_tool_call_examples_bound_their_output():
    """Issue #22 audit: the README's `tool_choice: required` examples without `max_tokens` ran for
    minutes (the grammar allows call after call; the default model kept calling up to its context)."""
    blocks = README.read_text().split("```")[1::2]
    required = [b for b in blocks if '"tool_choice": "required"' in b or 'tool_choice="required"' in b]
    assert len(required) >= 2
    for block in required:
        assert "max_tokens" in block and ("parallel_tool_calls=False" in block
                                          or '"parallel_tool_calls": false' in block), block
