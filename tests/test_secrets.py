"""Secrets stay secret: redacted Redis URLs, secret files, configs that need a cluster token,
help texts that do not echo secrets from the environment."""

from __future__ import annotations

import threading
from urllib.parse import urlparse

import pytest

from pagedserve.cli import build_parser
from pagedserve.launcher import LaunchError, Stack
from pagedserve.stack_config import StackConfig
from pagedserve.local_redis import redis_settings
from pagedserve.engine.config import SchedulerConfig
from pagedserve.engine.runner_config import RunnerConfig
from pagedserve.services.common.auth import read_secret
from pagedserve.services.common.grpc_server import (
    CLIENT_API_SERVER_OPTIONS, INTERNAL_CHANNEL_OPTIONS, INTERNAL_SERVER_OPTIONS, MiB,
)
from pagedserve.services.common.redis_wait import connect_redis
from pagedserve.services.common.service_args import redact_url
from pagedserve.services.scheduler.config import SchedulerServiceConfig


@pytest.mark.parametrize("url, shown", [
    ("redis://:s3cret@redis:6379/0", "redis://:***@redis:6379/0"),
    ("redis://alice:s3cret@10.0.0.5:6380/2", "redis://alice:***@10.0.0.5:6380/2"),
    ("rediss://s3cret@host", "rediss://***@host"),  # a password without its colon
    ("redis://:s3/c?r#et@host/0", "redis://:***@host/0"),  # unescaped URL characters in it
    ("redis://:p@ss@host/0", "redis://:***@host/0"),
    ("unix://:s3cret@/run/redis.sock?db=1", "unix://:***@/run/redis.sock?db=1"),
    ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
])
def test_redact_url_hides_the_password(url, shown):
    assert redact_url(url) == shown


def test_waiting_for_redis_never_shows_the_password():
    stop = threading.Event()
    stop.set()
    with pytest.raises(ConnectionError) as info:
        connect_redis("redis://:s3cret@127.0.0.1:1/0", stop)
    assert "s3cret" not in str(info.value) and "redis://:***@127.0.0.1:1/0" in str(info.value)


def test_launch_errors_never_show_the_password(tmp_path):
    config = StackConfig(model=tmp_path, workers=1, host="127.0.0.1", port=1, scheduler_port=2,
                         redis_url="redis://:s3cret@192.0.2.1:6379/0", runner=RunnerConfig(kv_cache_memory="64MiB"),
                         policy=SchedulerConfig(), threads_per_worker=1, data_dir=tmp_path)
    with pytest.raises(LaunchError) as info:
        Stack(config).start()  # no Redis answers there, and it is not local
    assert "s3cret" not in str(info.value) and "redis://:***@192.0.2.1:6379/0" in str(info.value)
    assert "s3cret" not in repr(config) and config.cluster_token not in repr(config)
    assert config.redis_password not in repr(config)
    assert len(config.cluster_token) == 64  # a random one per stack


def test_a_local_redis_gets_the_urls_password_in_its_settings(tmp_path):
    settings = redis_settings(6400, tmp_path, urlparse('redis://:p%40ss"w@127.0.0.1:6400/0'))
    assert 'requirepass "p@ss\\"w"' in settings.splitlines()
    assert "port 6400" in settings.splitlines()
    acl = redis_settings(6400, tmp_path, urlparse("redis://bob:pw@127.0.0.1:6400/0"))
    assert 'user "bob" on ">pw" ~* &* +@all' in acl.splitlines()
    assert not any(line.startswith(("requirepass", "user")) for line in
                   redis_settings(6400, tmp_path, urlparse("redis://127.0.0.1:6400/0")).splitlines())


def test_read_secret_takes_the_file_over_the_value(tmp_path):
    path = tmp_path / "token"
    path.write_text("  from-file\n")
    assert read_secret("from-flag", str(path), "the token") == "from-file"
    assert read_secret("from-flag", "", "the token") == "from-flag"
    path.write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        read_secret("", str(path), "the token")
    with pytest.raises(ValueError, match="printable ASCII"):
        read_secret("two words", "", "the token")
    with pytest.raises(OSError):
        read_secret("", str(tmp_path / "missing"), "the token")


def test_services_need_a_cluster_token_and_do_not_print_it():
    with pytest.raises(ValueError, match="PAGEDSERVE_CLUSTER_TOKEN"):
        SchedulerServiceConfig(redis_url="redis://127.0.0.1:6379/0", cluster_token="")
    config = SchedulerServiceConfig(redis_url="redis://:s3cret@127.0.0.1:6379/0", cluster_token="tok-123")
    assert "tok-123" not in repr(config) and "s3cret" not in repr(config)
    assert config.host == "127.0.0.1"


@pytest.mark.parametrize("command", ["scheduler", "worker", "gateway", "up"])
def test_help_does_not_echo_secrets_from_the_environment(monkeypatch, command):
    monkeypatch.setenv("PAGEDSERVE_REDIS_URL", "redis://:s3cret@redis:6379/0")
    monkeypatch.setenv("PAGEDSERVE_CLUSTER_TOKEN", "tok-from-env")
    monkeypatch.setenv("PAGEDSERVE_API_KEY", "key-from-env")
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    text = sub.format_help()
    assert "s3cret" not in text and "tok-from-env" not in text and "key-from-env" not in text
    assert "redis://:***@redis:6379/0" in text
    args = parser.parse_args([command])
    assert args.cluster_token == "tok-from-env" and args.host == "127.0.0.1"


def test_message_size_limits_are_explicit():
    def limits(options):
        return dict(options)["grpc.max_receive_message_length"], dict(options)["grpc.max_send_message_length"]

    assert limits(CLIENT_API_SERVER_OPTIONS) == (16 * MiB, 16 * MiB)
    assert limits(INTERNAL_SERVER_OPTIONS) == limits(INTERNAL_CHANNEL_OPTIONS) == (64 * MiB, 64 * MiB)
    assert dict(INTERNAL_SERVER_OPTIONS)["grpc.so_reuseport"] == 0


def test_short_cluster_tokens_are_refused():
    import argparse

    from pagedserve.services.common.auth import read_cluster_token

    with pytest.raises(ValueError, match="fewer than 16"):
        read_cluster_token("x", "")
