"""The gateway's command line: it finds its schedulers in Redis and takes no scheduler address."""

from __future__ import annotations

import pytest

from pagedserve.cli import build_parser
from pagedserve.config_flags import config_from_args
from pagedserve.services.gateway.config import GatewayConfig


def test_the_gateway_takes_no_scheduler_address(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PAGEDSERVE_CLUSTER_TOKEN", "a-long-enough-cluster-token")
    monkeypatch.setenv("PAGEDSERVE_SCHEDULER", "10.0.0.1:1")  # the removed variable is ignored
    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["gateway", "--scheduler", "127.0.0.1:50052"])
    assert "--scheduler" in capsys.readouterr().err
    args = parser.parse_args(["gateway", "--redis-url", "redis://127.0.0.1:6390/0", "--gateway-id", "gw-7"])
    config = config_from_args(GatewayConfig, args, model=tmp_path)
    assert (config.redis_url, config.gateway_id, config.cluster_token) == ("redis://127.0.0.1:6390/0", "gw-7", "a-long-enough-cluster-token")
    assert not hasattr(config, "scheduler_address") and "10.0.0.1" not in repr(config)
